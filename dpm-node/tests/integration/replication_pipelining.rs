//! A replicated memory node's tcp NIC carries many posts per connection to the backups at a
//! time: posts are applied as they arrive and answered in order once their barriers resolve,
//! instead of one barrier round trip per post; and a post waiting for its barrier when the
//! node stops is never answered "done".

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dinomo_dpm_node::replication::{Phase, Replicator, ReplicatorOptions};
use dinomo_fabric::grants::{GrantTable, WindowRange};
use dinomo_fabric::tcp::{TcpFabric, TcpNic};
use dinomo_fabric::{DurabilityRequest, Fabric, Op, PmRegion};

const LEN: u64 = 2 << 20;
/// How late the backup applies each post it gets.
const BACKUP_DELAY: Duration = Duration::from_millis(300);
const POSTS: u64 = 8;

/// A primary replicating to one backup that applies each post `BACKUP_DELAY` late (and
/// counts them), in sync; a KN's connection to the primary's NIC.
struct Setup {
    _dir: tempfile::TempDir,
    primary: Arc<PmRegion>,
    backup: Arc<PmRegion>,
    rep: Arc<Replicator>,
    backup_posts: Arc<AtomicU64>,
    kn: Arc<TcpFabric>,
    _nics: (TcpNic, TcpNic),
}

async fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let region = |name: &str| {
        Arc::new(
            PmRegion::create(&dir.path().join(name), LEN, DurabilityRequest::ProcessCrash).unwrap(),
        )
    };
    let (primary, backup) = (region("p"), region("b"));
    let backup_grants = Arc::new(GrantTable::create(&dir.path().join("b.grants"), 4).unwrap());
    let backup_key = backup_grants
        .grant_with_window(&[WindowRange::write(0, LEN)])
        .unwrap();
    let backup_posts = Arc::new(AtomicU64::new(0));
    let counter = backup_posts.clone();
    backup_grants.set_post_hook(Some(Arc::new(move |_| {
        counter.fetch_add(1, Ordering::Relaxed);
        std::thread::sleep(BACKUP_DELAY)
    })));
    let backup_nic = TcpNic::start(
        "127.0.0.1:0".parse().unwrap(),
        backup.clone(),
        backup_grants,
    )
    .await
    .unwrap();
    let rep = Replicator::new(
        primary.clone(),
        ReplicatorOptions {
            ack_timeout: Duration::from_secs(20),
        },
    );
    primary.set_mirror(Some(rep.clone()));
    rep.add("b", backup_nic.local_addr(), backup_key, None, None);
    let deadline = Instant::now() + Duration::from_secs(20);
    while rep.status()[0].phase != Phase::InSync {
        assert!(Instant::now() < deadline, "{:?}", rep.status());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let grants = Arc::new(GrantTable::create(&dir.path().join("p.grants"), 4).unwrap());
    let key = grants
        .grant_with_window(&[WindowRange::write(0, LEN)])
        .unwrap();
    let nic = TcpNic::start("127.0.0.1:0".parse().unwrap(), primary.clone(), grants)
        .await
        .unwrap();
    let kn = Arc::new(TcpFabric::connect(nic.local_addr(), key).await.unwrap());
    Setup {
        _dir: dir,
        primary,
        backup,
        rep,
        backup_posts,
        kn,
        _nics: (backup_nic, nic),
    }
}

/// `POSTS` WRITEs posted at once on the KN's connection.
fn post_all(kn: &Arc<TcpFabric>) -> Vec<tokio::task::JoinHandle<(u64, dinomo_fabric::Result<()>)>> {
    (0..POSTS)
        .map(|i| {
            let kn = kn.clone();
            tokio::spawn(async move {
                let op = Op::Write {
                    offset: 4096 + i * 64,
                    data: Bytes::from(vec![i as u8 + 1; 64]),
                };
                (i, kn.post(&[op]).await.map(|_| ()))
            })
        })
        .collect()
}

/// Post `i`'s WRITE is in the backup's pool.
fn assert_at_backup(t: &Setup, i: u64, what: &str) {
    let mut got = [0u8; 64];
    t.backup.read(4096 + i * 64, &mut got).unwrap();
    assert_eq!(got, [i as u8 + 1; 64], "post {i} {what}");
}

/// Eight WRITEs posted at once on one connection to the primary, with a backup that takes
/// 300 ms per post: with one barrier round trip per post the backup gets eight posts (one per
/// WRITE, each waited for before the next is read); carried together, their records share
/// posts. Each is answered only once it is at the backup.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn posts_on_one_connection_wait_for_the_backups_together() {
    let t = setup().await;
    let before = t.backup_posts.load(Ordering::Relaxed);
    for p in post_all(&t.kn) {
        let (i, r) = p.await.unwrap();
        r.unwrap();
        assert_at_backup(&t, i, "answered before the backup had it");
    }
    let posts = t.backup_posts.load(Ordering::Relaxed) - before;
    assert!(
        posts <= POSTS / 2,
        "the backup got {posts} posts for {POSTS} WRITEs: one barrier round trip each"
    );
    t.rep.end("test over");
}

/// Posts applied and waiting for their barriers when the primary stops (`end`: shutdown, or
/// deposed by a newer primary) are answered with an error, never "done": the backup may lack
/// them, and a promoted backup would lose them. (A barrier used to read the senders `end`
/// stops as backups removed from the set, and pass.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn posts_waiting_when_the_primary_stops_are_not_acknowledged() {
    let t = setup().await;
    let posts = post_all(&t.kn);
    // The first backup post (of the first WRITE's record) is in flight, the rest wait.
    tokio::time::sleep(BACKUP_DELAY / 3).await;
    t.rep.end("the primary stops");
    let mut acknowledged = Vec::new();
    for p in posts {
        let (i, r) = p.await.unwrap();
        if r.is_ok() {
            acknowledged.push(i);
        }
    }
    // Whatever was acknowledged must be at the backup (the first WRITE's may be).
    for &i in &acknowledged {
        assert_at_backup(&t, i, "acknowledged but not at the backup");
    }
    assert!(
        acknowledged.len() <= 1,
        "{acknowledged:?} acknowledged after the primary stopped"
    );
    let _ = &t.primary;
}
