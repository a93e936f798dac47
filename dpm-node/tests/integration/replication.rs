//! Replication of the memory node (docs/decisions/0007-dpm-replication.md), with real
//! processes: a primary and two backups; what the primary acknowledged is in every backup's
//! pool after the primary is killed, and a promoted backup fences the old primary.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use dinomo_dpm_node::config::DpmConfigFile;
use dinomo_dpm_node::segments::SegmentGrant;
use dinomo_dpm_node::testkit::{LogRecord, LogWriter, SegmentSource};
use dinomo_dpm_node::{Dpm, DpmError};
use dinomo_fabric::tcp::TcpFabric;
use dinomo_fabric::AccessKey;
use dinomo_layout::log::LogOp;
use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use dinomo_proto::dpm::replica_service_client::ReplicaServiceClient;
use dinomo_proto::dpm::{
    AllocateSegmentRequest, ForwardWritesRequest, GetMetadataRequest, PoolRange, PromoteRequest,
    PutMetadataRequest, RegisterKnRequest, RegisterKnResponse, ReplicaStatusRequest,
    ReplicaStatusResponse, SealSegmentRequest,
};
use tonic::transport::Channel;

use dinomo_dpm_node::replication::copy_marker::{copy_marker_path, read_copy_marker};
use dinomo_dpm_node::replication::role_file::role_path;
use dinomo_dpm_node::replication::{CopyMarker, CopyState};

use super::process::DpmProcess;

pub(super) fn config(dir: &Path, name: &str, extra: &str) -> (PathBuf, PathBuf) {
    let sub = dir.join(name);
    std::fs::create_dir_all(&sub).unwrap();
    let pool = sub.join("pool");
    let cfg = sub.join("dpm.toml");
    std::fs::write(
        &cfg,
        format!(
            "pool_path = {pool:?}\npool_size = \"64MiB\"\nsegment_size = \"128KiB\"\n\
             listen = \"127.0.0.1:0\"\nfabric_listen = \"127.0.0.1:0\"\nmetrics_listen = \"\"\n\
             initial_index_buckets = 256\ngc_interval_ms = 5\n{extra}\n"
        ),
    )
    .unwrap();
    (cfg, pool)
}

/// Two backups started (b1, b2) and the config of a primary that replicates to both, `extra`
/// appended to it; the backups' pools.
pub(super) fn two_backups(
    dir: &Path,
    extra: &str,
) -> (DpmProcess, DpmProcess, PathBuf, [PathBuf; 2]) {
    two_backups_on(dir, "tcp", extra)
}

/// [`two_backups`] with the primary serving KNs on `fabric`.
pub(super) fn two_backups_on(
    dir: &Path,
    fabric: &str,
    extra: &str,
) -> (DpmProcess, DpmProcess, PathBuf, [PathBuf; 2]) {
    let (c1, pool1) = config(dir, "b1", "role = \"backup\"");
    let (c2, pool2) = config(dir, "b2", "role = \"backup\"");
    let b1 = DpmProcess::start(&c1, &dir.join("b1.log"));
    let b2 = DpmProcess::start(&c2, &dir.join("b2.log"));
    let (cp, _) = config(
        dir,
        "p",
        &format!(
            "fabric = \"{fabric}\"\nbackups = [\"{}\", \"{}\"]\n{extra}",
            b1.grpc, b2.grpc
        ),
    );
    (b1, b2, cp, [pool1, pool2])
}

/// The config (`n.toml` in `dir`) of a primary started on the existing pool `pool` (a
/// backup's, promoted), `extra` appended.
fn promoted_config(dir: &Path, pool: &Path, extra: &str) -> PathBuf {
    let cfg = dir.join("n.toml");
    std::fs::write(
        &cfg,
        format!(
            "pool_path = {pool:?}\ncreate = false\nlisten = \"127.0.0.1:0\"\n\
             fabric_listen = \"127.0.0.1:0\"\nmetrics_listen = \"\"\n{extra}"
        ),
    )
    .unwrap();
    cfg
}

pub(super) async fn replica_status(addr: std::net::SocketAddr) -> ReplicaStatusResponse {
    ReplicaServiceClient::connect(format!("http://{addr}"))
        .await
        .unwrap()
        .status(ReplicaStatusRequest {})
        .await
        .unwrap()
        .into_inner()
}

/// Waits until the primary reports `n` backups, all in sync.
pub(super) async fn wait_in_sync(primary: std::net::SocketAddr, n: usize) -> ReplicaStatusResponse {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let s = replica_status(primary).await;
        if s.backups.len() == n && s.backups.iter().all(|b| b.state == "in-sync") {
            // How long the copies took: how close a passing run came to the deadline (shown
            // with --nocapture, as the VM runs tests, or when the test fails later).
            let copies: Vec<_> = s.backups.iter().map(|b| b.resync_ms).collect();
            println!("{n} backups in sync; their copies took {copies:?} ms");
            return s;
        }
        assert!(Instant::now() < deadline, "backups not in sync: {s:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A KN's segment calls over gRPC.
pub(super) struct GrpcSource {
    pub(super) client: tokio::sync::Mutex<DpmServiceClient<Channel>>,
    pub(super) kn: u32,
    pub(super) epoch: u64,
    /// The registration's `forward_writes` (a one-sided fabric): each batch is forwarded.
    pub(super) forward: bool,
}

#[async_trait]
impl SegmentSource for GrpcSource {
    async fn allocate(&self) -> dinomo_dpm_node::Result<SegmentGrant> {
        let r = self
            .client
            .lock()
            .await
            .allocate_segment(AllocateSegmentRequest {
                kn_id: self.kn,
                epoch: self.epoch,
                stream: 0,
                deletes_only: false,
            })
            .await
            .map_err(|s| DpmError::Replication(s.to_string()))?
            .into_inner();
        Ok(SegmentGrant {
            segment_id: r.segment_id,
            offset: r.offset,
            len: r.len,
            chain_seq: r.chain_seq,
            first_batch: r.first_batch,
            chain_seed: r.chain_seed,
        })
    }
    async fn seal(&self, segment: u64) -> dinomo_dpm_node::Result<u64> {
        Ok(self
            .client
            .lock()
            .await
            .seal_segment(SealSegmentRequest {
                kn_id: self.kn,
                epoch: self.epoch,
                segment_id: segment,
            })
            .await
            .map_err(|s| DpmError::Replication(s.to_string()))?
            .into_inner()
            .pending_segments)
    }
    async fn forward(&self, offset: u64, len: u64) -> dinomo_dpm_node::Result<()> {
        if !self.forward {
            return Ok(());
        }
        self.client
            .lock()
            .await
            .forward_writes(ForwardWritesRequest {
                kn_id: self.kn,
                epoch: self.epoch,
                ranges: vec![PoolRange { offset, len }],
            })
            .await
            .map_err(|s| DpmError::Replication(s.to_string()))?;
        Ok(())
    }
}

/// Registers KN `kn_id` at `dpm`: the client it registered with, the answer and its fabric key.
pub(super) async fn register(
    dpm: &DpmProcess,
    kn_id: u32,
) -> (DpmServiceClient<Channel>, RegisterKnResponse, AccessKey) {
    let mut client = dpm.client().await;
    let r = client
        .register_kn(RegisterKnRequest {
            pid: 0,
            pid_namespace: 0,
            forwards_writes: true,
            kn_id: Some(kn_id),
            endpoint: "127.0.0.1:1".into(),
        })
        .await
        .unwrap()
        .into_inner();
    let f = r.fabric.as_ref().unwrap();
    let key = AccessKey {
        slot: f.grant_slot,
        generation: f.grant_generation,
        secret: f.grant_secret.as_slice().try_into().unwrap(),
    };
    (client, r, key)
}

/// Registers a KN at `dpm` and returns its log writer over the tcp fabric.
pub(super) async fn kn_writer(dpm: &DpmProcess) -> (u32, LogWriter<TcpFabric, GrpcSource>) {
    let (client, r, key) = register(dpm, 1).await;
    let f = r.fabric.as_ref().unwrap();
    let fabric = TcpFabric::connect(f.address.parse().unwrap(), key)
        .await
        .unwrap();
    let source = GrpcSource {
        client: tokio::sync::Mutex::new(client),
        kn: r.kn_id,
        epoch: r.epoch,
        forward: r.forward_writes,
    };
    (r.kn_id, LogWriter::new(fabric, source))
}

pub(super) fn record(i: u32) -> LogRecord {
    LogRecord {
        op: LogOp::Put,
        version: u64::from(i) + 1,
        key: format!("key-{i}").into_bytes(),
        value: format!("value-{i}-{}", "x".repeat(200)).into_bytes(),
    }
}

/// Opens a backup's pool as a primary would after a failover, merges what the KNs left open,
/// and returns which of the `keys` records are missing or wrong, and the metadata entry.
pub(super) fn check_pool(
    pool: &Path,
    kns: &[u32],
    keys: impl IntoIterator<Item = u32>,
) -> (Vec<u32>, Option<Vec<u8>>) {
    let mut file = DpmConfigFile::in_process(pool);
    file.create = false;
    let dpm: Arc<Dpm> = Dpm::open(file.validate().unwrap()).unwrap();
    for &kn in kns {
        dpm.merge_all(kn, true).unwrap();
    }
    let bad = keys
        .into_iter()
        .filter(|&i| {
            let r = record(i);
            dpm.lookup(&r.key).unwrap().map(|f| f.value) != Some(r.value)
        })
        .collect();
    let meta = dpm.get_metadata("test/replicated");
    dpm.shutdown();
    (bad, meta)
}

/// Every batch the primary acknowledged, and a metadata write, are in both backups' pools
/// after the primary is killed; each backup's pool opens as a primary's (recovery) with them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_batches_survive_the_primary_in_every_backup() {
    let dir = tempfile::tempdir().unwrap();
    let (mut b1, mut b2, cp, [pool1, pool2]) = two_backups(dir.path(), "");
    let mut primary = DpmProcess::start(&cp, &dir.path().join("p.log"));
    let s = wait_in_sync(primary.grpc, 2).await;
    assert_eq!(s.role, "primary");
    assert!(s.term >= 1, "{s:?}");
    for b in [&b1, &b2] {
        let bs = replica_status(b.grpc).await;
        assert_eq!((bs.role.as_str(), bs.term), ("backup", s.term), "{bs:?}");
    }
    // Reported in sync only once each backup recorded its copy complete.
    for pool in [&pool1, &pool2] {
        let m = read_copy_marker(pool).unwrap();
        assert!(
            matches!(m, Some(CopyMarker { state: CopyState::Complete, term, .. }) if term == s.term),
            "{}: {m:?}",
            pool.display()
        );
    }

    let (kn, mut w) = kn_writer(&primary).await;
    const KEYS: u32 = 400;
    for chunk in (0..KEYS).collect::<Vec<_>>().chunks(8) {
        let recs: Vec<LogRecord> = chunk.iter().map(|&i| record(i)).collect();
        w.append(&recs).await.unwrap();
    }
    primary
        .client()
        .await
        .put_metadata(PutMetadataRequest {
            name: "test/replicated".into(),
            value: Some(b"yes".to_vec()),
        })
        .await
        .unwrap();
    let s = replica_status(primary.grpc).await;
    for b in &s.backups {
        assert_eq!(b.state, "in-sync", "{s:?}");
        assert!(b.bytes_sent > 0 && b.resync_bytes > 0, "{s:?}");
    }

    primary.kill9();
    b1.kill9();
    b2.kill9();
    for pool in [&pool1, &pool2] {
        let (bad, meta) = check_pool(pool, &[kn], 0..KEYS);
        assert!(
            bad.is_empty(),
            "{} of {KEYS} acknowledged records missing in {} (first: key-{})",
            bad.len(),
            pool.display(),
            bad[0]
        );
        assert_eq!(meta.as_deref(), Some(&b"yes"[..]), "{}", pool.display());
        // Opened as a primary's pool: the marker is gone, the pool is a primary's own now.
        assert_eq!(read_copy_marker(pool).unwrap(), None, "{}", pool.display());
    }
}

/// A backup promoted (started as a primary on its pool) takes the next term and attaches the
/// other backup: from then on the old primary, still running, acknowledges nothing, and stops
/// once it finds the backup taken over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_promoted_backup_fences_the_old_primary() {
    let dir = tempfile::tempdir().unwrap();
    let (b1, mut b2, cp, [_, pool2]) = two_backups(dir.path(), "replica_ack_timeout_ms = 1000");
    let mut old = DpmProcess::start(&cp, &dir.path().join("p.log"));
    let s = wait_in_sync(old.grpc, 2).await;
    let (_, mut w) = kn_writer(&old).await;
    w.append(&[record(0)]).await.unwrap();

    // Promote b2: stop it, start a primary on its pool that replicates to b1.
    b2.kill9();
    let cn = promoted_config(
        dir.path(),
        &pool2,
        &format!("fabric = \"tcp\"\nbackups = [\"{}\"]\n", b1.grpc),
    );
    let new = DpmProcess::start(&cn, &dir.path().join("n.log"));
    let ns = wait_in_sync(new.grpc, 1).await;
    assert!(ns.term > s.term, "new term {} after {}", ns.term, s.term);
    assert_eq!(replica_status(b1.grpc).await.term, ns.term);

    // The old primary's writes are no longer acknowledged: b1 revoked its key, b2 is gone.
    let e = w.append(&[record(1)]).await;
    assert!(
        e.is_err(),
        "the old primary acknowledged a write after the promotion"
    );
    // And the new primary serves its KN.
    let (_, mut w2) = kn_writer(&new).await;
    w2.append(&[record(2)]).await.unwrap();
    // The old primary learns it was deposed (b1 now answers with a newer term) and stops.
    assert!(
        old.exits_within(Duration::from_secs(15)),
        "the deposed primary still runs; log:\n{}",
        std::fs::read_to_string(dir.path().join("p.log")).unwrap_or_default()
    );
}

/// Asks the backup at `addr` to become the primary, replicating to `backups`.
pub(super) async fn promote(
    addr: std::net::SocketAddr,
    backups: Vec<String>,
    min_term: u64,
) -> Result<dinomo_proto::dpm::PromoteResponse, tonic::Status> {
    ReplicaServiceClient::connect(format!("http://{addr}"))
        .await
        .map_err(|e| tonic::Status::unavailable(e.to_string()))?
        .promote(PromoteRequest { backups, min_term })
        .await
        .map(|r| r.into_inner())
}

/// `Promote` on a backup whose copy is complete makes that process the primary, at its own
/// addresses, with no restart and no file moved (what a failover on Kubernetes needs): it
/// takes a later term, attaches the other backup, holds everything the old primary
/// acknowledged and serves KNs; the old primary, still running, acknowledges nothing more and
/// stops. A backup whose pool no primary copied, and a primary, are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_promoted_in_place_serves_as_the_primary() {
    let dir = tempfile::tempdir().unwrap();
    let (c3, _) = config(dir.path(), "b3", "role = \"backup\"");
    let b3 = DpmProcess::start(&c3, &dir.path().join("b3.log"));
    let (b1, mut b2, cp, [_, pool2]) = two_backups(dir.path(), "replica_ack_timeout_ms = 1000");
    let mut old = DpmProcess::start(&cp, &dir.path().join("p.log"));
    let s = wait_in_sync(old.grpc, 2).await;
    let (kn, mut w) = kn_writer(&old).await;
    const KEYS: u32 = 64;
    for chunk in (0..KEYS).collect::<Vec<_>>().chunks(8) {
        let recs: Vec<LogRecord> = chunk.iter().map(|&i| record(i)).collect();
        w.append(&recs).await.unwrap();
    }
    old.client()
        .await
        .put_metadata(PutMetadataRequest {
            name: "test/replicated".into(),
            value: Some(b"yes".to_vec()),
        })
        .await
        .unwrap();

    let e = promote(b3.grpc, vec![], s.term).await.unwrap_err();
    assert!(
        e.code() == tonic::Code::FailedPrecondition && e.message().contains("no copy marker"),
        "{e:?}"
    );
    let e = promote(b1.grpc, vec![], s.term).await.unwrap_err();
    assert!(e.message().contains("name at least one backup"), "{e:?}");
    // ALREADY_EXISTS, not a refusal: a node already promoted answers so to a repeated
    // Promote (the monitor then waits for it instead of promoting another backup).
    let e = promote(old.grpc, vec![], s.term).await.unwrap_err();
    assert!(
        e.code() == tonic::Code::AlreadyExists
            && e.message().contains("only a backup can be promoted"),
        "{e:?}"
    );

    let r = promote(b2.grpc, vec![b1.grpc.to_string()], s.term)
        .await
        .unwrap();
    assert_eq!(
        (r.accepted_term, r.copy_term),
        (s.term + 1, s.term),
        "{r:?}"
    );
    // Refused, or nothing listens any more (the backup's server stopped).
    let e = promote(b2.grpc, vec![], s.term).await;
    assert!(e.is_err(), "promoted twice: {e:?}");

    // The same address answers as a primary of a later term, with b1 in sync.
    let deadline = Instant::now() + Duration::from_secs(30);
    let ns = loop {
        let now = async {
            ReplicaServiceClient::connect(format!("http://{}", b2.grpc))
                .await
                .ok()?
                .status(ReplicaStatusRequest {})
                .await
                .ok()
        };
        if let Some(st) = now.await {
            let st = st.into_inner();
            if st.role == "primary" && st.backups.len() == 1 && st.backups[0].state == "in-sync" {
                break st;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the promoted backup is not a primary in sync with b1; log:\n{}",
            std::fs::read_to_string(dir.path().join("b2.log")).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(ns.term > s.term, "new term {} after {}", ns.term, s.term);
    assert_eq!(replica_status(b1.grpc).await.term, ns.term);

    // The old primary's writes are not acknowledged any more.
    let e = w.append(&[record(KEYS)]).await;
    assert!(
        e.is_err(),
        "the old primary acknowledged a write after the promotion"
    );
    // The new one holds what the old one acknowledged, and serves a KN.
    let meta = b2
        .client()
        .await
        .get_metadata(GetMetadataRequest {
            name: "test/replicated".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .value;
    assert_eq!(meta.as_deref(), Some(&b"yes"[..]));
    let (kn2, mut w2) = kn_writer(&b2).await;
    w2.append(&[record(KEYS + 1)]).await.unwrap();
    assert!(
        old.exits_within(Duration::from_secs(15)),
        "the deposed primary still runs; log:\n{}",
        std::fs::read_to_string(dir.path().join("p.log")).unwrap_or_default()
    );
    // The old primary, deposed, recorded that it is a backup now: restarted on its pool (as
    // a Kubernetes StatefulSet restarts it), it serves as one.
    let old_pool = dir.path().join("p").join("pool");
    assert_eq!(
        std::fs::read_to_string(role_path(&old_pool))
            .unwrap()
            .trim(),
        "backup"
    );
    let mut rejoined = DpmProcess::start(&cp, &dir.path().join("p-rejoined.log"));
    assert_eq!(replica_status(rejoined.grpc).await.role, "backup");
    rejoined.kill9();
    // Without that record (deleted; or a primary killed before it learned it was deposed) it
    // starts as a primary, twice (each start takes a later term: the second one newer than
    // the promoted primary's). Its pool's image is term s.term's and b1 accepted ns.term
    // since: b1 refuses it, it stops, and b1 stays the promoted primary's backup.
    // Each refusal records it as a backup again (b1 accepted a term after its image).
    for round in 0..2 {
        std::fs::remove_file(role_path(&old_pool)).unwrap();
        let log = dir.path().join(format!("p-again-{round}.log"));
        let mut again = DpmProcess::start(&cp, &log);
        assert!(
            again.exits_within(Duration::from_secs(15)),
            "the old primary, restarted, still runs; log:\n{}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        assert_eq!(
            std::fs::read_to_string(role_path(&old_pool))
                .unwrap_or_default()
                .trim(),
            "backup",
            "round {round}"
        );
    }
    let b1s = replica_status(b1.grpc).await;
    assert_eq!(
        (b1s.term, b1s.primary.as_str()),
        (ns.term, b2.grpc.to_string().as_str()),
        "the restarted old primary took b1 over"
    );
    let (_, mut w3) = kn_writer(&b2).await;
    w3.append(&[record(KEYS + 2)]).await.unwrap();

    // The promoted node restarts (its pod does) with its backup's command line: it comes
    // back as the primary (it recorded its promotion), takes a later term and b1 follows.
    b2.kill9();
    let mut b2 = DpmProcess::start(
        &dir.path().join("b2").join("dpm.toml"),
        &dir.path().join("b2-again.log"),
    );
    let again = wait_in_sync(b2.grpc, 1).await;
    assert!(again.role == "primary" && again.term > ns.term, "{again:?}");
    let (kn3, mut w4) = kn_writer(&b2).await;
    w4.append(&[record(KEYS + 3)]).await.unwrap();

    // b2 is lost in turn: b1 is promoted, to replicate to b2. b2 comes back (its pod
    // restarts) as the primary it recorded, is refused by b1 and stops, recording that it is
    // a backup now; started again, it is one, and b1 attaches it.
    b2.kill9();
    let r = promote(b1.grpc, vec![b2.grpc.to_string()], again.term)
        .await
        .expect("b1, in sync under b2, is promotable");
    assert_eq!(r.copy_term, again.term, "{r:?}");
    let b2_config = dir.path().join("b2").join("dpm.toml");
    let b2_port = ["--listen", &b2.grpc.to_string()];
    let log = dir.path().join("b2-deposed.log");
    let mut stale = DpmProcess::start_with_args(&b2_config, &log, &b2_port);
    assert!(
        stale.exits_within(Duration::from_secs(15)),
        "b2, back as a primary, was not refused; log:\n{}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert_eq!(
        std::fs::read_to_string(role_path(&pool2)).unwrap().trim(),
        "backup"
    );
    let mut b2 =
        DpmProcess::start_with_args(&b2_config, &dir.path().join("b2-backup.log"), &b2_port);
    let b1s = wait_in_sync(b1.grpc, 1).await;
    assert!(b1s.role == "primary" && b1s.term > again.term, "{b1s:?}");
    assert_eq!(replica_status(b2.grpc).await.role, "backup");
    let (kn4, mut w5) = kn_writer(&b1).await;
    w5.append(&[record(KEYS + 4)]).await.unwrap();

    // Every record acknowledged by any primary is in b1's pool.
    let pool1 = dir.path().join("b1").join("pool");
    let mut b1 = b1;
    b1.kill9();
    b2.kill9();
    let (bad, _) = check_pool(
        &pool1,
        &[kn, kn2, kn3, kn4],
        (0..KEYS).chain([KEYS + 1, KEYS + 2, KEYS + 3, KEYS + 4]),
    );
    assert!(
        bad.is_empty(),
        "records missing after the promotion: {bad:?}"
    );
}

/// Sends SIGSTOP to `pid` and waits until each of its threads is stopped: kill() returns
/// before they are (a thread running on another CPU stops at its next interrupt; in a VM
/// under load that took milliseconds, during which the backup answered a post, once).
pub(super) fn stop_process(pid: u32) {
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let all_stopped = std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("stat")).ok())
            // The state follows the command name in parentheses, which may hold spaces.
            .all(|stat| {
                stat.rsplit_once(") ")
                    .is_some_and(|(_, rest)| rest.starts_with('t') || rest.starts_with('T'))
            });
        if all_stopped {
            return;
        }
        assert!(Instant::now() < deadline, "process {pid} did not stop");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A backup that stops answering (SIGSTOP) holds back every acknowledgement: the KN's WRITE
/// fails (outcome unknown) instead of being acknowledged on the primary alone, and so does a
/// control call, until the backup is removed from the set; added again, it is copied anew.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_backup_holds_acknowledgements_until_it_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let (b1, _b2, cp, _) = two_backups(dir.path(), "replica_ack_timeout_ms = 800");
    let primary = DpmProcess::start(&cp, &dir.path().join("p.log"));
    wait_in_sync(primary.grpc, 2).await;
    let (_, mut w) = kn_writer(&primary).await;
    w.append(&[record(0)]).await.unwrap();

    stop_process(b1.pid());
    let t = Instant::now();
    let e = w.append(&[record(1)]).await;
    assert!(
        e.is_err(),
        "acknowledged while a backup in sync was stopped"
    );
    assert!(
        t.elapsed() >= Duration::from_millis(700),
        "{:?}",
        t.elapsed()
    );
    // The backup's own post times out too (it began a little after the KN's barrier did):
    // only then is it failed. Resumed before that, it would answer that post and stay in
    // sync, having made one acknowledgement fail (CI saw this once).
    let deadline = Instant::now() + Duration::from_secs(10);
    let s = loop {
        let s = replica_status(primary.grpc).await;
        if s.backups.iter().any(|b| b.state == "failed") || Instant::now() > deadline {
            break s;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    // SAFETY: a signal to our own child.
    unsafe { libc::kill(b1.pid() as i32, libc::SIGCONT) };
    let failed: Vec<_> = s.backups.iter().filter(|b| b.state == "failed").collect();
    assert_eq!(failed.len(), 1, "{s:?}");
    assert_eq!(failed[0].address, b1.grpc.to_string());
    // A control call is not acknowledged either.
    let put = primary
        .client()
        .await
        .put_metadata(PutMetadataRequest {
            name: "test/x".into(),
            value: Some(b"1".to_vec()),
        })
        .await;
    assert_eq!(put.unwrap_err().code(), tonic::Code::Unavailable);

    // Removed: the primary acknowledges with the other backup alone.
    let mut rc = ReplicaServiceClient::connect(format!("http://{}", primary.grpc))
        .await
        .unwrap();
    rc.remove_backup(dinomo_proto::dpm::BackupRequest {
        address: b1.grpc.to_string(),
    })
    .await
    .unwrap();
    // The KN's session ended with its failed WRITE (a torn tail): a new registration.
    let (_, mut w) = kn_writer(&primary).await;
    w.append(&[record(2)]).await.unwrap();
    // Added again: copied from scratch, then in sync.
    rc.add_backup(dinomo_proto::dpm::BackupRequest {
        address: b1.grpc.to_string(),
    })
    .await
    .unwrap();
    let s = wait_in_sync(primary.grpc, 2).await;
    let b = s
        .backups
        .iter()
        .find(|b| b.address == b1.grpc.to_string())
        .unwrap();
    assert!(b.resync_bytes > 0 && b.resync_ms > 0, "{b:?}");
    w.append(&[record(3)]).await.unwrap();
}

/// With `reattach_failed_backups` (what the Helm chart sets: nothing else tends the set
/// there), a backup killed and started again on its address is attached anew by the primary
/// itself: in sync again, and writes are acknowledged, with no RemoveBackup or AddBackup
/// call. The copy is incremental: the restarted backup keeps its pool, and the primary sends
/// fewer bytes than the pool's non-zero chunks (what a copy to an empty pool sends); every
/// acknowledged record is in its pool afterwards. (Without it, `a_stopped_backup_holds_acknowledgements_until
/// _it_is_removed` shows the failed backup holding every acknowledgement.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_backup_is_attached_anew_when_reattach_is_on() {
    let dir = tempfile::tempdir().unwrap();
    // A fixed gRPC port: the restarted backup must answer where the primary looks for it
    // (outside the ephemeral range, where a client connection's TIME_WAIT could hold it).
    let port = dinomo_node_common::address::free_port_base(&[0]).expect("a free port");
    let (c1, pool1) = config(
        dir.path(),
        "b1",
        &format!("role = \"backup\"\nlisten = \"127.0.0.1:{port}\""),
    );
    // `listen` appears twice otherwise: keep the last one only.
    let text = std::fs::read_to_string(&c1).unwrap();
    std::fs::write(&c1, text.replacen("listen = \"127.0.0.1:0\"\n", "", 1)).unwrap();
    let mut b1 = DpmProcess::start(&c1, &dir.path().join("b1.log"));
    let (cp, primary_pool) = config(
        dir.path(),
        "p",
        &format!(
            "fabric = \"tcp\"\nbackups = [\"{}\"]\nreplica_ack_timeout_ms = 800\n\
             reattach_failed_backups = true",
            b1.grpc
        ),
    );
    let mut primary = DpmProcess::start(&cp, &dir.path().join("p.log"));
    wait_in_sync(primary.grpc, 1).await;
    let (kn0, mut w) = kn_writer(&primary).await;
    // About 3 MiB of log: chunks that do not change after the backup dies, even if merges
    // and segment states rewrite the chunks of the index and of the last segments meanwhile
    // (with 1 MiB, a merge late on a loaded machine changed all 3 non-zero MiB once).
    const KEYS: u32 = 12_000;
    for chunk in (0..KEYS).collect::<Vec<_>>().chunks(16) {
        let recs: Vec<LogRecord> = chunk.iter().map(|&i| record(i)).collect();
        w.append(&recs).await.unwrap();
    }

    b1.kill9();
    assert!(
        w.append(&[record(KEYS + 100)]).await.is_err(),
        "acknowledged while the only backup in sync was dead"
    );
    let mut b1 = DpmProcess::start(&c1, &dir.path().join("b1-again.log"));
    let s = wait_in_sync(primary.grpc, 1).await;
    let copy = s.backups[0].clone();
    // What a copy to an empty pool would have sent: the primary's non-zero MiB, now.
    let nonzero_chunks = {
        let bytes = std::fs::read(&primary_pool).unwrap();
        bytes
            .chunks(1 << 20)
            .filter(|c| c.iter().any(|&b| b != 0))
            .count() as u64
    };
    let (kn1, mut w) = kn_writer(&primary).await;
    for i in KEYS..KEYS + 10 {
        w.append(&[record(i)]).await.unwrap();
    }

    primary.kill9();
    b1.kill9();
    let log = std::fs::read_to_string(dir.path().join("b1-again.log")).unwrap();
    assert!(
        log.contains("kept the pool for an incremental copy"),
        "{log}"
    );
    assert!(
        copy.resync_bytes < nonzero_chunks << 20,
        "sent {} bytes, as many as the {nonzero_chunks} non-zero MiB of the pool: not \
         incremental ({copy:?})",
        copy.resync_bytes
    );
    assert_eq!(
        copy.resync_bytes + copy.resync_skipped_bytes,
        64 << 20,
        "{copy:?}"
    );
    let (bad, _) = check_pool(&pool1, &[kn0, kn1], 0..KEYS + 10);
    assert!(
        bad.is_empty(),
        "{} acknowledged records missing in the re-copied backup (first: key-{})",
        bad.len(),
        bad[0]
    );
}

/// A backup killed (SIGKILL) while its primary is still copying the pool to it keeps a copy
/// marker that says "incomplete": a dpm-node refuses to start as a primary on that pool,
/// naming the marker, and starts with --accept-incomplete-copy (which removes the marker).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_killed_while_copying_is_not_opened_as_a_primary() {
    let dir = tempfile::tempdir().unwrap();
    let (c1, _) = config(dir.path(), "b1", "role = \"backup\"");
    let (c2, pool2) = config(dir.path(), "b2", "role = \"backup\"");
    let b1 = DpmProcess::start(&c1, &dir.path().join("b1.log"));
    let mut b2 = DpmProcess::start(&c2, &dir.path().join("b2.log"));
    let (cp, _) = config(
        dir.path(),
        "p",
        &format!(
            "fabric = \"tcp\"\nbackups = [\"{}\"]\nreplica_ack_timeout_ms = 1000",
            b1.grpc
        ),
    );
    // A larger pool: the copy reads every chunk (zero ones too), so it takes long enough for
    // the test to stop the backup in the middle of it.
    let text = std::fs::read_to_string(&cp).unwrap();
    std::fs::write(
        &cp,
        text.replace("pool_size = \"64MiB\"", "pool_size = \"256MiB\""),
    )
    .unwrap();
    let primary = DpmProcess::start(&cp, &dir.path().join("p.log"));
    let s = wait_in_sync(primary.grpc, 1).await;
    // About 12 MiB of log: the copy sends chunks while it still reads the rest of the pool
    // (it sends once more than 8 non-zero chunks are queued), so a backup can be stopped
    // after it received some of the pool and before it received all of it.
    let (_, mut w) = kn_writer(&primary).await;
    for i in 0..240u32 {
        let r = LogRecord {
            op: LogOp::Put,
            version: u64::from(i) + 1,
            key: format!("big-{i}").into_bytes(),
            value: vec![b'v'; 50 << 10],
        };
        w.append(&[r]).await.unwrap();
    }
    let mut rc = ReplicaServiceClient::connect(format!("http://{}", primary.grpc))
        .await
        .unwrap();
    let b2_addr = b2.grpc.to_string();
    let state_of = |s: &ReplicaStatusResponse| {
        s.backups
            .iter()
            .find(|b| b.address == b2_addr)
            .map(|b| (b.state.clone(), b.bytes_sent))
    };
    // Attach b2 and stop it once the first chunks reached it, while the copy goes on. If the
    // copy finished first (a fast machine), start over.
    let mut caught = false;
    for attempt in 1..=5 {
        rc.add_backup(dinomo_proto::dpm::BackupRequest {
            address: b2_addr.clone(),
        })
        .await
        .unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let st = state_of(&replica_status(primary.grpc).await);
            if st.as_ref().is_some_and(|(_, sent)| *sent > 0) {
                break;
            }
            assert!(Instant::now() < deadline, "nothing copied to b2: {st:?}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        stop_process(b2.pid());
        let st = state_of(&replica_status(primary.grpc).await);
        if st.as_ref().is_some_and(|(state, _)| state == "syncing") {
            eprintln!("b2 stopped in the middle of its copy (attempt {attempt}): {st:?}");
            caught = true;
            break;
        }
        // SAFETY: a signal to our own child.
        unsafe { libc::kill(b2.pid() as i32, libc::SIGCONT) };
        rc.remove_backup(dinomo_proto::dpm::BackupRequest {
            address: b2_addr.clone(),
        })
        .await
        .unwrap();
    }
    assert!(
        caught,
        "the copy to b2 always finished before b2 could be stopped"
    );
    b2.kill9();
    let m = read_copy_marker(&pool2).unwrap();
    assert!(
        matches!(m, Some(CopyMarker { state: CopyState::Incomplete, term, .. }) if term == s.term),
        "{m:?}"
    );

    // A primary on that pool is refused, saying why.
    let cn = promoted_config(dir.path(), &pool2, "");
    let log = dir.path().join("n.log");
    let refused = DpmProcess::try_start(&cn, &log, &[]);
    assert!(refused.is_err(), "a primary started on a half-copied pool");
    let out = std::fs::read_to_string(&log).unwrap();
    let marker = copy_marker_path(&pool2).display().to_string();
    assert!(
        out.contains(&marker)
            && out.contains("unfinished")
            && out.contains("--accept-incomplete-copy"),
        "{out}"
    );
    assert!(read_copy_marker(&pool2).unwrap().is_some());

    // With the override it opens, and the marker is gone: the pool is a primary's now.
    let mut accepted = DpmProcess::start_with_args(
        &cn,
        &dir.path().join("n-accepted.log"),
        &["--accept-incomplete-copy"],
    );
    assert_eq!(read_copy_marker(&pool2).unwrap(), None);
    accepted.kill9();
    let out = std::fs::read_to_string(dir.path().join("n-accepted.log")).unwrap();
    assert!(out.contains("UNFINISHED copy"), "{out}");
    drop(primary);
    drop(b1);
}
