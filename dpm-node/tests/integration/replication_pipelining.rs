//! A replicated memory node's tcp NIC carries many posts per connection to the backups at a
//! time: posts are applied as they arrive and answered in order once their barriers resolve,
//! instead of one barrier round trip per post; and a post waiting for its barrier when the
//! node stops is never answered "done".

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
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

/// Holds the backup's posts while closed (open at first).
#[derive(Default)]
struct Gate {
    closed: Mutex<bool>,
    opened: Condvar,
}

impl Gate {
    fn set_closed(&self, closed: bool) {
        *self.closed.lock().unwrap() = closed;
        self.opened.notify_all();
    }

    fn wait_open(&self) {
        let mut closed = self.closed.lock().unwrap();
        while *closed {
            closed = self.opened.wait(closed).unwrap();
        }
    }
}

/// A tokio runtime of its own for the backup's NIC, whose post hook blocks its thread: on
/// the test's runtime a blocked worker can hold the primary's tasks (its LIFO slot is not
/// stolen by the other workers) until the backup's acknowledgement times out.
struct BackupRuntime(Option<tokio::runtime::Runtime>);

impl Drop for BackupRuntime {
    fn drop(&mut self) {
        // Dropping a runtime inside the test's async context would panic.
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

/// A primary replicating to one backup that applies each post `BACKUP_DELAY` late (and
/// counts them, and holds them while `gate` is closed), in sync; a KN's connection to the
/// primary's NIC.
struct Setup {
    _dir: tempfile::TempDir,
    primary: Arc<PmRegion>,
    backup: Arc<PmRegion>,
    rep: Arc<Replicator>,
    backup_posts: Arc<AtomicU64>,
    gate: Arc<Gate>,
    kn: Arc<TcpFabric>,
    _nics: (TcpNic, TcpNic),
    _backup_runtime: BackupRuntime,
}

/// The backup's NIC, on a runtime of its own with `workers` threads (see [`BackupRuntime`]).
async fn backup_nic(
    backup: &Arc<PmRegion>,
    grants: Arc<GrantTable>,
    workers: usize,
) -> (TcpNic, BackupRuntime) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .unwrap();
    let nic = rt
        .spawn(TcpNic::start(
            "127.0.0.1:0".parse().unwrap(),
            backup.clone(),
            grants,
        ))
        .await
        .unwrap()
        .unwrap();
    (nic, BackupRuntime(Some(rt)))
}

/// A replicator installed as `primary`'s mirror.
fn replicator(primary: &Arc<PmRegion>) -> Arc<Replicator> {
    let rep = Replicator::new(
        primary.clone(),
        ReplicatorOptions {
            ack_timeout: Duration::from_secs(20),
        },
    );
    primary.set_mirror(Some(rep.clone()));
    rep
}

/// Waits until the replicator's one backup is in sync.
async fn wait_in_sync(rep: &Replicator) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while rep.status()[0].phase != Phase::InSync {
        assert!(Instant::now() < deadline, "{:?}", rep.status());
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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
    let gate = Arc::new(Gate::default());
    let (counter, hook_gate) = (backup_posts.clone(), gate.clone());
    backup_grants.set_post_hook(Some(Arc::new(move |_| {
        counter.fetch_add(1, Ordering::Relaxed);
        hook_gate.wait_open();
        std::thread::sleep(BACKUP_DELAY)
    })));
    let (backup_nic, backup_runtime) = backup_nic(&backup, backup_grants, 2).await;
    let rep = replicator(&primary);
    rep.add("b", backup_nic.local_addr(), backup_key, None, None);
    wait_in_sync(&rep).await;
    // On a multi-threaded runtime (as in the dpm-node) the sender is a task, not a thread.
    assert!(
        !thread_names().iter().any(|n| n.starts_with("replicate b")),
        "a sender thread on a multi-threaded runtime: {:?}",
        thread_names()
    );
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
        gate,
        kn,
        _nics: (backup_nic, nic),
        _backup_runtime: backup_runtime,
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
/// stops as backups removed from the set, and pass.) The backup's posts are held until the
/// primary stopped, so no barrier can have passed before, whatever the scheduling; once
/// released, the backup's acknowledgements must not make any pass either.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn posts_waiting_when_the_primary_stops_are_not_acknowledged() {
    let t = setup().await;
    t.gate.set_closed(true);
    let before = t.backup_posts.load(Ordering::Relaxed);
    let posts = post_all(&t.kn);
    // Every WRITE applied at the primary, and the backup holding the first of its posts.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let applied = (0..POSTS).all(|i| {
            let mut got = [0u8; 64];
            t.primary.read(4096 + i * 64, &mut got).unwrap();
            got == [i as u8 + 1; 64]
        });
        if applied && t.backup_posts.load(Ordering::Relaxed) > before {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the WRITEs never reached the primary"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    // Every post waits for its barrier (none failed for another reason before the stop).
    for (i, p) in posts.iter().enumerate() {
        assert!(
            !p.is_finished(),
            "post {i} answered before the primary stopped"
        );
    }
    t.rep.end("the primary stops");
    t.gate.set_closed(false);
    let mut acknowledged = Vec::new();
    for p in posts {
        let (i, r) = p.await.unwrap();
        if r.is_ok() {
            acknowledged.push(i);
        }
    }
    assert!(
        acknowledged.is_empty(),
        "{acknowledged:?} acknowledged after the primary stopped"
    );
}

/// The names of this process's threads.
fn thread_names() -> Vec<String> {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

/// A backup added outside a multi-threaded runtime (here a current-thread one) gets a sender
/// thread of its own instead of a task (the dpm-node's own senders are tasks on its runtime):
/// that path copies the pool and carries records to the backup too, each barrier answered
/// only once the backup holds what was recorded before it.
#[tokio::test]
async fn a_sender_of_its_own_thread_replicates_too() {
    let dir = tempfile::tempdir().unwrap();
    let region = |name: &str| {
        Arc::new(
            PmRegion::create(&dir.path().join(name), LEN, DurabilityRequest::ProcessCrash).unwrap(),
        )
    };
    let (primary, backup) = (region("p"), region("b"));
    // Written before the backup is added: it gets it with the copy of the pool.
    primary.write(0, &[9; 64]).unwrap();
    let backup_grants = Arc::new(GrantTable::create(&dir.path().join("b.grants"), 4).unwrap());
    let backup_key = backup_grants
        .grant_with_window(&[WindowRange::write(0, LEN)])
        .unwrap();
    let (backup_nic, _backup_runtime) = backup_nic(&backup, backup_grants, 1).await;
    let rep = replicator(&primary);
    rep.add("own", backup_nic.local_addr(), backup_key, None, None);
    wait_in_sync(&rep).await;
    // (Checked once the copy is done: a new thread names itself only once it runs.)
    assert!(
        thread_names()
            .iter()
            .any(|n| n.starts_with("replicate own")),
        "no sender thread: {:?}",
        thread_names()
    );
    for i in 0..20u64 {
        let at = 4096 + i * 64;
        primary.write(at, &[i as u8 + 1; 64]).unwrap();
        primary.persist(at, 64).unwrap();
        primary.mirror_barrier().await.unwrap();
        let mut got = [0u8; 64];
        backup.read(at, &mut got).unwrap();
        assert_eq!(
            got,
            [i as u8 + 1; 64],
            "record {i} answered before the backup had it"
        );
    }
    let mut got = [0u8; 64];
    backup.read(0, &mut got).unwrap();
    assert_eq!(
        got, [9; 64],
        "the copy of the pool missed what was written before the add"
    );
    rep.end("test over");
}
