//! The incremental copy (issue 14: re-replication), in process: a backup that already holds
//! most of the pool gets only the chunks that differ, and ends byte for byte equal to the
//! primary, writes made during the copy included.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use dinomo_dpm_node::replication::digest::{self, BackupChunks};
use dinomo_dpm_node::replication::{Phase, Replicator, ReplicatorOptions};
use dinomo_fabric::grants::{GrantTable, WindowRange};
use dinomo_fabric::tcp::TcpNic;
use dinomo_fabric::{DurabilityRequest, PmRegion};

const MIB: u64 = 1 << 20;
const LEN: u64 = 8 * MIB;

fn region(path: &Path) -> Arc<PmRegion> {
    Arc::new(PmRegion::create(path, LEN, DurabilityRequest::ProcessCrash).unwrap())
}

/// Fills chunk `chunk` of `r` with a pattern of `tag` (non-zero).
fn fill(r: &PmRegion, chunk: u64, tag: u8) {
    let bytes: Vec<u8> = (0..MIB).map(|i| tag ^ (i as u8) | 1).collect();
    r.write_durable(chunk * MIB, &bytes).unwrap();
}

fn whole(r: &PmRegion) -> Vec<u8> {
    let mut out = vec![0u8; r.len() as usize];
    r.read(0, &mut out).unwrap();
    out
}

/// The primary's chunks 0-3, 6 and 7 hold data, 4 and 5 are zero. The backup held a copy,
/// then diverged: chunk 2 changed, chunk 4 holds data where the primary has none, chunk 6 is
/// zero where the primary has data. Only those three are sent; writes made while the copy
/// runs reach the backup too; and once in sync the backup equals the primary byte for byte.
/// (Sending every chunk would pass the equality but not the byte count; skipping zero chunks,
/// as for a backup that starts from zeroes, would leave chunk 4's stale data.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_gets_only_the_chunks_it_does_not_hold() {
    // The MiBs that differ: 2, 4, 6; and 1, 5 if written before the copy read them.
    copy_and_compare(MIB, 3 * MIB..=5 * MIB).await;
}

/// The same with 2 MiB chunks (what pools above 64 GiB get): a chunk is read, compared and
/// sent a MiB at a time, each MiB at its own place in the record order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chunks_larger_than_a_write_are_copied_a_mib_at_a_time() {
    // Chunks 1 (MiB 2-3), 2 (4-5) and 3 (6-7) differ; 0 (MiB 1) if written before it is read.
    copy_and_compare(2 * MIB, 6 * MIB..=8 * MIB).await;
}

async fn copy_and_compare(chunk_bytes: u64, sent: std::ops::RangeInclusive<u64>) {
    let dir = tempfile::tempdir().unwrap();
    let primary = region(&dir.path().join("p"));
    let backup = region(&dir.path().join("b"));
    for (chunk, tag) in [(0, 3), (1, 5), (2, 7), (3, 9), (6, 11), (7, 13)] {
        fill(&primary, chunk, tag);
        fill(&backup, chunk, tag);
    }
    backup.write_durable(2 * MIB + 4096, &[0xee; 64]).unwrap();
    fill(&backup, 4, 17);
    backup
        .write_durable(6 * MIB, &vec![0u8; MIB as usize])
        .unwrap();

    let key = [0x5e; digest::KEY_BYTES];
    let file = std::fs::File::open(dir.path().join("b")).unwrap();
    let wire = digest::file_digests(&file, LEN, chunk_bytes, &key, false).unwrap();
    let held = BackupChunks::from_wire(LEN, chunk_bytes, key, &wire).unwrap();

    let grants = Arc::new(GrantTable::create(&dir.path().join("b.grants"), 4).unwrap());
    let key = grants
        .grant_with_window(&[WindowRange::write(0, LEN)])
        .unwrap();
    // Each post lands 20 ms late: the writes below are made while chunks are still queued.
    grants.set_post_hook(Some(Arc::new(|_| {
        std::thread::sleep(Duration::from_millis(20))
    })));
    let nic = TcpNic::start("127.0.0.1:0".parse().unwrap(), backup.clone(), grants)
        .await
        .unwrap();
    let rep = Replicator::new(
        primary.clone(),
        ReplicatorOptions {
            ack_timeout: Duration::from_secs(10),
        },
    );
    primary.set_mirror(Some(rep.clone()));
    rep.add("b", nic.local_addr(), key, Some(held), None);

    // A line of MiB 7 (the last one read) changed and changed back, both persisted: its
    // records are queued, most likely before it is read, and it is still held (it equals
    // the backup's again); the backup ends with the line as it is.
    primary.write_durable(7 * MIB + 256, &[0x99; 64]).unwrap();
    let mut line = [0u8; 64];
    backup.read(7 * MIB + 256, &mut line).unwrap();
    primary.write_durable(7 * MIB + 256, &line).unwrap();
    // Writes during the copy: into chunks the backup holds (1; 5, zero on both), and into
    // chunks it lacks (2 and 6); into a held one (3) once in sync.
    for (i, off) in [MIB + 64, 2 * MIB + 128, 5 * MIB, 6 * MIB + 8192]
        .into_iter()
        .enumerate()
    {
        primary.write_durable(off, &[0x40 + i as u8; 64]).unwrap();
    }

    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        let s = rep.status();
        if s[0].phase == Phase::InSync {
            break s[0].clone();
        }
        assert!(
            Instant::now() < deadline && !s[0].phase.name().starts_with("failed"),
            "{s:?}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    primary.write_durable(3 * MIB + 640, &[0x77; 64]).unwrap();
    primary.mirror_barrier().await.unwrap();

    let (p, b) = (whole(&primary), whole(&backup));
    let first_diff = p.iter().zip(&b).position(|(x, y)| x != y);
    assert_eq!(
        first_diff, None,
        "the backup differs from the primary at byte {first_diff:?}"
    );
    // A write into a held MiB that came before the copy read it makes it differ (sent);
    // after, the write's record reaches the backup.
    assert_eq!(status.resync_bytes + status.resync_skipped_bytes, LEN);
    assert!(
        sent.contains(&status.resync_bytes),
        "sent {} bytes in chunks of {chunk_bytes}, expected {sent:?}: {status:?}",
        status.resync_bytes
    );
}
