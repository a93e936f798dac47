//! Fencing in the middle of a post (issue 10, finding 7).
//!
//! A post is paused by the grant table's post hook after its key passed the check and before
//! it is applied; the fence (revoking the key through the memory node's grant table, then
//! reading what a MergeAll right after the fence would see) runs during the pause; then the
//! post resumes. Whatever the backend, a post that is acknowledged as applied must have been
//! in place when the fence returned: otherwise the fenced writer's client is told "done" about
//! a write that no merge indexes.
//!
//! - tcp: the NIC runs in the memory node, so the fence waits for the paused post.
//! - shm: the writer's own CPU applies the post and cannot be stopped from the memory node, so
//!   the fence returns at once and the late post must be reported as outcome-unknown.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use dinomo_fabric::grants::{GrantTable, WindowRange};
use dinomo_fabric::shm::ShmFabric;
use dinomo_fabric::tcp::{TcpFabric, TcpNic};
use dinomo_fabric::{AccessKey, DurabilityRequest, FabricError, FabricExt, PmRegion};

const LEN: u64 = 1 << 20;
const OFF: u64 = 4096;
const DATA: &[u8] = b"a batch of the fenced KN";

struct Node {
    _dir: tempfile::TempDir,
    pool: std::path::PathBuf,
    region: Arc<PmRegion>,
    grants: Arc<GrantTable>,
}

fn node() -> Node {
    let dir = tempfile::tempdir().unwrap();
    let pool = dir.path().join("pool");
    let region = Arc::new(PmRegion::create(&pool, LEN, DurabilityRequest::Auto).unwrap());
    let grants = Arc::new(GrantTable::create(&GrantTable::path_for(&pool), 8).unwrap());
    Node {
        _dir: dir,
        pool,
        region,
        grants,
    }
}

/// The first post through `grants` after this call stops in the hook until resumed.
struct Pause {
    paused: mpsc::Receiver<AccessKey>,
    resume: mpsc::Sender<()>,
}

fn pause_first_post(grants: &GrantTable) -> Pause {
    let (paused_tx, paused) = mpsc::channel();
    let (resume, resume_rx) = mpsc::channel::<()>();
    let resume_rx = Mutex::new(resume_rx);
    let armed = AtomicBool::new(true);
    grants.set_post_hook(Some(Arc::new(move |key| {
        if armed.swap(false, Ordering::SeqCst) {
            let _ = paused_tx.send(key);
            let _ = resume_rx
                .lock()
                .unwrap()
                .recv_timeout(Duration::from_secs(10));
        }
    })));
    Pause { paused, resume }
}

/// What happened around the fence.
struct Fenced {
    /// The fence returned while the post was still paused between check and apply.
    returned_while_paused: bool,
    /// The bytes at the post's target right after the fence returned.
    seen: Vec<u8>,
}

/// Waits for the post to pause, runs `revoke` and then reads the target on a thread of its
/// own (the DPM's FenceKn followed by MergeAll), resumes the post and returns what it saw.
fn fence_during_pause(
    pause: Pause,
    region: Arc<PmRegion>,
    revoke: impl FnOnce() + Send + 'static,
) -> Fenced {
    pause
        .paused
        .recv_timeout(Duration::from_secs(10))
        .expect("the post reached the hook");
    let fence = std::thread::spawn(move || {
        revoke();
        let mut seen = vec![0u8; DATA.len()];
        region.read(OFF, &mut seen).unwrap();
        seen
    });
    let deadline = std::time::Instant::now() + Duration::from_millis(300);
    while !fence.is_finished() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    let returned_while_paused = fence.is_finished();
    pause.resume.send(()).unwrap();
    Fenced {
        returned_while_paused,
        seen: fence.join().unwrap(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_fence_waits_for_a_post_between_check_and_apply() {
    let n = node();
    let nic = TcpNic::start(
        "127.0.0.1:0".parse().unwrap(),
        n.region.clone(),
        n.grants.clone(),
    )
    .await
    .unwrap();
    let key = n
        .grants
        .grant_with_window(&[WindowRange::write(0, LEN)])
        .unwrap();
    let kn = TcpFabric::connect(nic.local_addr(), key).await.unwrap();
    let pause = pause_first_post(&n.grants);
    let post = tokio::spawn(async move {
        let r = kn.write(OFF, Bytes::from_static(DATA)).await;
        (r, kn)
    });
    let (grants, region) = (n.grants.clone(), n.region.clone());
    let fenced = tokio::task::spawn_blocking(move || {
        fence_during_pause(pause, region, move || grants.revoke(key).unwrap())
    })
    .await
    .unwrap();
    let (acked, kn) = post.await.unwrap();
    if acked.is_ok() {
        assert_eq!(
            fenced.seen, DATA,
            "the WRITE was acknowledged but was not in place when the fence returned \
             (the fence returned while the post was paused: {})",
            fenced.returned_while_paused
        );
    }
    assert!(
        !fenced.returned_while_paused,
        "the tcp fence returned while a post checked against the old key could still apply"
    );
    acked.expect("a post that passed the check before the fence completes");
    assert!(matches!(
        kn.write(OFF, Bytes::from_static(b"later")).await,
        Err(FabricError::AccessDenied { .. })
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_post_revoked_between_check_and_apply_is_not_acknowledged() {
    let n = node();
    let key = n
        .grants
        .grant_with_window(&[WindowRange::write(0, LEN)])
        .unwrap();
    // The KN maps the pool and the grant table itself, as in its own process.
    let kn = ShmFabric::connect(&n.pool, key, DurabilityRequest::Auto).unwrap();
    let pause = pause_first_post(kn.grants());
    let post = tokio::spawn(async move {
        let r = kn.write(OFF, Bytes::from_static(DATA)).await;
        (r, kn)
    });
    let (grants, region) = (n.grants.clone(), n.region.clone());
    let fenced = tokio::task::spawn_blocking(move || {
        fence_during_pause(pause, region, move || grants.revoke(key).unwrap())
    })
    .await
    .unwrap();
    let (acked, kn) = post.await.unwrap();
    assert!(
        fenced.returned_while_paused,
        "nothing in the memory node can wait for an shm writer's CPU"
    );
    if let Ok(()) = acked {
        assert_eq!(
            fenced.seen, DATA,
            "the WRITE was acknowledged but landed after the fence returned"
        );
    }
    let e = acked.expect_err("a post that landed after the fence is not acknowledged");
    assert!(
        matches!(e, FabricError::RevokedDuringPost { slot } if slot == key.slot),
        "{e}"
    );
    assert!(e.is_permanent(), "retrying a fenced post cannot help");
    assert!(e.is_revoked(), "the error proves the key is gone");
    assert!(matches!(
        kn.write(OFF, Bytes::from_static(b"later")).await,
        Err(FabricError::AccessDenied { .. })
    ));
}

/// Writers post WRITEs (several in flight) while another thread revokes their key at a random
/// moment and then reads what a merge would see: every WRITE acknowledged as done must be in
/// that picture, on both backends.
async fn acknowledged_writes_are_in_place_when_revoke_returns(
    connect: impl Fn(&Node, AccessKey) -> futures_like::BoxFuture<Connected>,
) {
    const WRITERS: u64 = 4;
    const PER_WRITER: u64 = 2000;
    for round in 0..10u64 {
        let n = node();
        let key = n
            .grants
            .grant_with_window(&[WindowRange::write(0, LEN)])
            .unwrap();
        let (fabric, _nic) = connect(&n, key).await;
        let mut writers = Vec::new();
        for w in 0..WRITERS {
            let f = fabric.clone();
            writers.push(tokio::spawn(async move {
                let mut acked = Vec::new();
                for i in 0..PER_WRITER {
                    let off = 8 * (w * PER_WRITER + i);
                    let v = Bytes::copy_from_slice(&(off + 1).to_le_bytes());
                    match f.write(off, v).await {
                        Ok(()) => acked.push(off),
                        Err(_) => break,
                    }
                }
                acked
            }));
        }
        let (grants, region) = (n.grants.clone(), n.region.clone());
        let seen = tokio::task::spawn_blocking(move || {
            std::thread::sleep(Duration::from_micros(200 + 300 * round));
            grants.revoke(key).unwrap();
            let mut seen = vec![0u8; (8 * WRITERS * PER_WRITER) as usize];
            region.read(0, &mut seen).unwrap();
            seen
        })
        .await
        .unwrap();
        let (mut acked_total, mut refused) = (0, 0);
        for w in writers {
            let acked = w.await.unwrap();
            acked_total += acked.len();
            refused += usize::from(acked.len() < PER_WRITER as usize);
            for off in acked {
                let at = off as usize;
                assert_eq!(
                    u64::from_le_bytes(seen[at..at + 8].try_into().unwrap()),
                    off + 1,
                    "round {round}: the WRITE at {off} was acknowledged but not in place when \
                     the revoke returned"
                );
            }
        }
        eprintln!(
            "round {round}: {acked_total} WRITEs acknowledged, {refused} writers fenced mid-way"
        );
    }
}

/// A handle, and whatever must outlive it (the tcp NIC).
type Connected = (
    Arc<dyn dinomo_fabric::Fabric>,
    Option<Box<dyn std::any::Any + Send>>,
);

mod futures_like {
    pub type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_racing_revoke_never_loses_an_acknowledged_write() {
    acknowledged_writes_are_in_place_when_revoke_returns(|n, key| {
        let (region, grants) = (n.region.clone(), n.grants.clone());
        Box::pin(async move {
            let nic = TcpNic::start("127.0.0.1:0".parse().unwrap(), region, grants)
                .await
                .unwrap();
            let f = TcpFabric::connect(nic.local_addr(), key).await.unwrap();
            let nic: Box<dyn std::any::Any + Send> = Box::new(nic);
            (Arc::new(f) as Arc<dyn dinomo_fabric::Fabric>, Some(nic))
        })
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_racing_revoke_never_loses_an_acknowledged_write() {
    acknowledged_writes_are_in_place_when_revoke_returns(|n, key| {
        let f = ShmFabric::connect(&n.pool, key, DurabilityRequest::Auto).unwrap();
        Box::pin(async move { (Arc::new(f) as Arc<dyn dinomo_fabric::Fabric>, None) })
    })
    .await;
}
