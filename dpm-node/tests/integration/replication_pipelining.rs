//! A replicated memory node's tcp NIC carries many posts per connection to the backups at a
//! time: posts are applied as they arrive and answered in order once their barriers resolve,
//! instead of one barrier round trip per post.

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

/// Eight WRITEs posted at once on one connection to the primary, with a backup that takes
/// 300 ms per post: with one barrier round trip per post they take at least 8 x 300 ms; carried
/// together they take a few. Each is answered only once it is at the backup.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn posts_on_one_connection_wait_for_the_backups_together() {
    let dir = tempfile::tempdir().unwrap();
    let primary = Arc::new(
        PmRegion::create(&dir.path().join("p"), LEN, DurabilityRequest::ProcessCrash).unwrap(),
    );
    let backup = Arc::new(
        PmRegion::create(&dir.path().join("b"), LEN, DurabilityRequest::ProcessCrash).unwrap(),
    );

    let backup_grants = Arc::new(GrantTable::create(&dir.path().join("b.grants"), 4).unwrap());
    let backup_key = backup_grants
        .grant_with_window(&[WindowRange::write(0, LEN)])
        .unwrap();
    backup_grants.set_post_hook(Some(Arc::new(|_| std::thread::sleep(BACKUP_DELAY))));
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

    let t = Instant::now();
    let posts: Vec<_> = (0..POSTS)
        .map(|i| {
            let kn = kn.clone();
            tokio::spawn(async move {
                let op = Op::Write {
                    offset: 4096 + i * 64,
                    data: Bytes::from(vec![i as u8 + 1; 64]),
                };
                kn.post(&[op]).await.unwrap();
                // Answered: it is at the backup.
                i
            })
        })
        .collect();
    for p in posts {
        let i = p.await.unwrap();
        let mut got = [0u8; 64];
        backup.read(4096 + i * 64, &mut got).unwrap();
        assert_eq!(
            got,
            [i as u8 + 1; 64],
            "post {i} answered before the backup had it"
        );
    }
    let took = t.elapsed();
    assert!(
        took < BACKUP_DELAY * (POSTS as u32) / 2,
        "{POSTS} posts took {took:?}: one backup round trip ({BACKUP_DELAY:?}) each"
    );
}
