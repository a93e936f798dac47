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

use super::process::DpmProcess;

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

/// A backup configured for verbs, promoted in place after the primary's death, serves its KNs
/// verbs (a KN registering there is told verbs and stores through its RDMA NIC), holds what
/// the old primary's KN forwarded, and replicates the new KN's batches to the other backup.
/// Before, a promoted backup served tcp whatever its KNs were on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verbs_backup_promoted_in_place_serves_verbs() {
    use super::replication::{config, promote, wait_in_sync};
    use super::replication_one_sided::{
        append_all, assert_forwarded_records_in, one_sided_writer, wait_until_primary,
    };
    use std::time::Duration;

    if !rdma_device_here() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let backup = "role = \"backup\"\nfabric = \"verbs\"";
    let (c1, pool1) = config(dir.path(), "b1", backup);
    let (c2, pool2) = config(dir.path(), "b2", backup);
    let mut b1 = DpmProcess::start(&c1, &dir.path().join("b1.log"));
    let mut b2 = DpmProcess::start(&c2, &dir.path().join("b2.log"));
    let (cp, _) = config(
        dir.path(),
        "p",
        &format!(
            "fabric = \"verbs\"\nbackups = [\"{}\", \"{}\"]",
            b1.grpc, b2.grpc
        ),
    );
    let mut primary = DpmProcess::start(&cp, &dir.path().join("p.log"));
    let s = wait_in_sync(primary.grpc, 2).await;
    let (_, mut old_kn) = one_sided_writer(&primary, 1, true).await;
    append_all(&mut old_kn, 0..100).await;

    primary.kill9();
    promote(b1.grpc, vec![b2.grpc.to_string()], s.term)
        .await
        .unwrap();
    wait_until_primary(b1.grpc, Duration::from_secs(60)).await;
    // It acknowledges nothing (registrations included) until a backup took its term.
    wait_in_sync(b1.grpc, 1).await;
    let (_, r, _) = super::replication::register(&b1, 3).await;
    let kind = r.fabric.as_ref().unwrap().kind();
    assert_eq!(
        kind,
        dinomo_proto::dpm::FabricKind::Verbs,
        "the promoted backup serves {kind:?}"
    );
    let (asked, mut new_kn) = one_sided_writer(&b1, 2, true).await;
    assert!(
        asked,
        "the promoted primary, replicated, asks its KNs to forward"
    );
    append_all(&mut new_kn, 100..200).await;

    b1.kill9();
    b2.kill9();
    for pool in [&pool1, &pool2] {
        assert_forwarded_records_in(pool, &[1, 2], 0..200);
    }
    println!("verbs: the promoted backup served verbs and kept all 200 forwarded records");
}

/// A backup configured for verbs whose pool would be a file on a DAX filesystem refuses to
/// start: the kernel does not let RDMA register such pages, so it could not serve once
/// promoted, and a failover is the wrong moment to find that out. Runs where the VM has its
/// DAX mount (DINOMO_PM_DIR); skipped elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verbs_backup_refuses_a_pool_on_a_dax_filesystem() {
    if !rdma_device_here() {
        return;
    }
    let Some(pm) = std::env::var_os("DINOMO_PM_DIR") else {
        assert!(
            std::env::var_os("DINOMO_VM_TESTS").is_none(),
            "scripts/vm-tests.sh must set DINOMO_PM_DIR"
        );
        println!("SKIPPED: DINOMO_PM_DIR is not set (no DAX filesystem outside the test VM)");
        return;
    };
    let dir = tempfile::tempdir_in(&pm).unwrap();
    let (text, pool) = refused_start(dir.path(), "b", "role = \"backup\"\nfabric = \"verbs\"");
    assert!(
        text.contains("DAX filesystem") && text.contains("RDMA"),
        "{text}"
    );
    assert_no_probe_left(&pool);
    // With process-crash durability the probe is mapped without MAP_SYNC, but its pages are
    // DAX pages all the same: the registration on the device refuses them.
    let (text, _) = refused_start(
        dir.path(),
        "pc",
        "role = \"backup\"\nfabric = \"verbs\"\ndurability = \"process-crash\"",
    );
    assert!(
        text.contains("cannot register") && text.contains("for remote writes"),
        "{text}"
    );
    // The same backup on tcp starts there.
    let (cfg, _) = super::replication::config(dir.path(), "t", "role = \"backup\"");
    DpmProcess::start(&cfg, &dir.path().join("t.log")).kill9();
}

/// A backup configured for verbs that could not serve verbs once promoted refuses to start,
/// with the reason: here its RDMA device does not exist (the same check registers a probe
/// file's pages on the device, which finds a kernel that does not let RDMA pin that
/// filesystem's pages the same way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verbs_backup_without_its_rdma_device_refuses_to_start() {
    if !rdma_device_here() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (text, pool) = refused_start(
        dir.path(),
        "b",
        "role = \"backup\"\nfabric = \"verbs\"\nrdma_device = \"nosuch0\"",
    );
    assert!(
        text.contains("fabric = \"verbs\" on a backup") && text.contains("nosuch0"),
        "{text}"
    );
    assert_no_probe_left(&pool);
    // Its device named: it starts, and says it checked.
    let device = std::env::var("DINOMO_RDMA_DEVICE")
        .ok()
        .filter(|d| !d.is_empty())
        .unwrap_or_else(|| device_names().remove(0));
    let (cfg, _) = super::replication::config(
        dir.path(),
        "ok",
        &format!("role = \"backup\"\nfabric = \"verbs\"\nrdma_device = \"{device}\""),
    );
    let log = dir.path().join("ok.log");
    DpmProcess::start(&cfg, &log).kill9();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        text.contains("checked: this backup's RDMA device registers"),
        "{text}"
    );
}

/// Starts a dpm-node from `extra` (a config named `name` in `dir`), which must refuse to
/// start; returns the reason and its log in one text, and its pool path.
fn refused_start(dir: &std::path::Path, name: &str, extra: &str) -> (String, std::path::PathBuf) {
    let (cfg, pool) = super::replication::config(dir, name, extra);
    let log = dir.join(format!("{name}.log"));
    let e = DpmProcess::try_start(&cfg, &log, &[]).unwrap_err();
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    (format!("{e}; log: {text}"), pool)
}

/// A verbs backup's start-up probe (`<pool>.verbs-probe`) is gone, whatever it found.
fn assert_no_probe_left(pool: &std::path::Path) {
    let mut probe = pool.as_os_str().to_owned();
    probe.push(".verbs-probe");
    assert!(
        !std::path::Path::new(&probe).exists(),
        "the probe file was left behind"
    );
}

/// A verbs memory node that may not pin its pool for even one KN (no CAP_IPC_LOCK, a
/// RLIMIT_MEMLOCK below the pool) refuses to start, naming both ways out; before, it started
/// and every KN's registration failed with ENOMEM. With room for two writing connections
/// (each the pool, the cell space and one segment) it starts, says how many KNs that serves,
/// and the kernel's accounting (rxe's: a hardware NIC may pin queue buffers too) agrees: two
/// connections register and write, a third cannot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verbs_node_that_may_not_pin_its_pool_refuses_to_start() {
    use super::replication_one_sided::{append_all, one_sided_writer};
    use dinomo_dpm_node::verbs_pins::PinNeed;

    if !rdma_device_here() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (cfg, pool) = super::replication::config(dir.path(), "p", "fabric = \"verbs\"");
    let log = dir.path().join("p.log");
    let e = DpmProcess::try_start_with(&cfg, &log, &[], |c| pinning_limited(c, 1 << 20))
        .map(|mut p| p.kill9())
        .expect_err("a verbs node that may pin 1 MiB started with a 64 MiB pool");
    let text = format!(
        "{e}; log: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    assert!(
        text.contains("may pin only 1048576 bytes (RLIMIT_MEMLOCK, no CAP_IPC_LOCK)")
            && text.contains("--cap-add IPC_LOCK")
            && text.contains("ulimit -l unlimited"),
        "{text}"
    );
    // Room for two writing connections (a KN of one shard is one, and one that only READs):
    // the need of the pool the refused start made.
    let head = std::fs::read(&pool).unwrap();
    let sb = dinomo_layout::superblock::Superblock::decode(&head[..4096]).unwrap();
    let two = 2 * PinNeed::of(&sb, 4096).per_connection(1);
    let log = dir.path().join("p2.log");
    let mut node = start_pinning_limited(&cfg, &log, two);
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        text.contains("about 0 KNs of 2 shards (1 of one shard)"),
        "{text}"
    );
    let mut connections = Vec::new();
    for kn in [1, 2] {
        let (_, mut w) = one_sided_writer(&node, kn, false).await;
        append_all(&mut w, 0..100).await;
        connections.push(w); // connected (and pinning) until the end
    }
    let (_, r, key) = super::replication::register(&node, 3).await;
    let side = r.fabric.as_ref().unwrap().address.parse().unwrap();
    let third = VerbsFabric::connect(side, key).await;
    drop(connections);
    node.kill9();
    let e = third.expect_err("a third connection registered the pool");
    assert!(
        e.to_string().contains("Cannot allocate memory"),
        "the third connection failed, but not for the pin limit: {e}"
    );
}

/// A verbs memory node whose pool is a file of an ordinary disk filesystem (ext4 without DAX,
/// in the page cache): from Linux 6.5 on the kernel refuses RDMA's long-term pins of such
/// pages for writing (EFAULT), so every KN's write window would fail to register. There the
/// node refuses to start, saying why and where to put the pool; on older kernels it serves a
/// KN that registers and writes. Runs where scripts/vm-tests.sh mounted that filesystem
/// (DINOMO_PAGE_CACHE_DIR); skipped elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verbs_node_on_a_file_the_kernel_will_not_pin_refuses_to_start_or_serves() {
    use super::replication_one_sided::{append_all, one_sided_writer};

    if !rdma_device_here() {
        return;
    }
    let Some(fs) = std::env::var("DINOMO_PAGE_CACHE_DIR").ok() else {
        assert!(
            std::env::var_os("DINOMO_VM_TESTS").is_none(),
            "scripts/vm-tests.sh must set DINOMO_PAGE_CACHE_DIR"
        );
        println!("SKIPPED: DINOMO_PAGE_CACHE_DIR is not set (not under scripts/vm-tests.sh)");
        return;
    };
    // An ext4 without DAX mounted there, not the directory left on tmpfs by a failed mount.
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap();
    assert!(
        mounts.lines().any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[1] == fs && f[2] == "ext4" && !f[3].contains("dax")
        }),
        "no ext4 without DAX is mounted at {fs}: {mounts}"
    );
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let version: Vec<u32> = release
        .split(|c: char| !c.is_ascii_digit())
        .take(2)
        .map(|n| n.parse().unwrap())
        .collect();
    let refuses = version >= vec![6, 5];
    let dir = tempfile::tempdir_in(&fs).unwrap();
    // Not prefaulted: writing 64 MiB through a loop device is slow in the emulated VM, and
    // the other tests run beside this one.
    let (cfg, _) =
        super::replication::config(dir.path(), "p", "fabric = \"verbs\"\nprefault = false");
    let log = dir.path().join("p.log");
    let started = DpmProcess::try_start(&cfg, &log, &[]);
    match (refuses, started) {
        (true, Err(e)) => {
            let text = format!(
                "{e}; log: {}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            assert!(
                text.contains("Bad address") && text.contains("put the pool on a device-DAX"),
                "{text}"
            );
            println!("verbs: kernel {release}: a pool in the page cache is refused at start");
        }
        (false, Ok(mut node)) => {
            let (_, mut w) = one_sided_writer(&node, 1, false).await;
            append_all(&mut w, 0..100).await;
            drop(w);
            node.kill9();
            println!("verbs: kernel {release}: a pool in the page cache serves a KN");
        }
        (true, Ok(mut node)) => {
            node.kill9();
            panic!("kernel {release} refuses such pins, yet the node started");
        }
        (false, Err(e)) => panic!("kernel {release}: the node did not start: {e}"),
    }
}

/// A backup configured for verbs that may not pin the pool its primary copies to it keeps the
/// copy (it is durability) and warns, once the copy is complete, that it could not serve it
/// over verbs once promoted, and its status says it is not promotable; a Promote is refused
/// with the reason (FAILED_PRECONDITION, so a monitor tries another backup) and it stays a
/// backup, instead of being promoted and then refusing to start at every restart. The probe at its start passed: it is one page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_verbs_backup_that_may_not_pin_the_primarys_pool_says_so_and_is_not_promoted() {
    use super::replication::{config, promote, wait_in_sync};
    use std::time::Duration;

    if !rdma_device_here() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (cb, bpool) = config(dir.path(), "b", "role = \"backup\"\nfabric = \"verbs\"");
    let blog = dir.path().join("b.log");
    let mut backup = start_pinning_limited(&cb, &blog, 1 << 20);
    // A promotion names at least one backup: a second one, on tcp and unlimited.
    let (c2, _) = config(dir.path(), "b2", "role = \"backup\"");
    let mut other = DpmProcess::start(&c2, &dir.path().join("b2.log"));
    let (cp, _) = config(
        dir.path(),
        "p",
        &format!("backups = [\"{}\", \"{}\"]", backup.grpc, other.grpc),
    );
    let mut primary = DpmProcess::start(&cp, &dir.path().join("p.log"));
    let s = wait_in_sync(primary.grpc, 2).await;
    let text = std::fs::read_to_string(&blog).unwrap_or_default();
    assert!(
        text.contains("once promoted it could not serve it over verbs")
            && text.contains("may pin only 1048576 bytes"),
        "{text}"
    );
    // Its status says so before anyone tries (`dinomo status` prints it).
    let before = super::replication::replica_status(backup.grpc).await;
    assert_eq!(before.copy_state, "complete");
    assert!(
        before.not_promotable.contains("may pin only 1048576 bytes"),
        "{before:?}"
    );
    primary.kill9();
    let refused = promote(backup.grpc, vec![other.grpc.to_string()], s.term).await;
    let still_running = !backup.exits_within(Duration::from_secs(2));
    let text = std::fs::read_to_string(&blog).unwrap_or_default();
    // Refused before anything was recorded: still a backup of the same term, no role file.
    let after = super::replication::replica_status(backup.grpc).await;
    backup.kill9();
    other.kill9();
    let e = refused.expect_err("a backup that cannot pin its pool was promoted");
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(
        e.message()
            .contains("could not serve its pool over verbs once promoted")
            && e.message().contains("may pin only 1048576 bytes"),
        "{e:?}"
    );
    assert!(still_running, "the refused backup stopped: {text}");
    assert_eq!((after.role.as_str(), after.term), ("backup", s.term));
    let mut role = bpool.as_os_str().to_owned();
    role.push(".role");
    assert!(
        !std::path::Path::new(&role).exists(),
        "the refused promotion recorded a role"
    );
}

/// Starts a dpm-node from `config` with [`pinning_limited`] to `bytes`, which must start.
fn start_pinning_limited(
    config: &std::path::Path,
    log: &std::path::Path,
    bytes: u64,
) -> DpmProcess {
    DpmProcess::try_start_with(config, log, &[], |c| pinning_limited(c, bytes)).unwrap_or_else(
        |e| {
            panic!(
                "{e}; log: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            )
        },
    )
}

/// Makes `cmd` start the way an unprivileged user or a container without IPC_LOCK does:
/// CAP_IPC_LOCK dropped from the bounding set (so root's exec does not grant it) and a soft
/// and hard RLIMIT_MEMLOCK of `bytes`.
fn pinning_limited(cmd: &mut std::process::Command, bytes: u64) {
    use std::os::unix::process::CommandExt;
    const CAP_IPC_LOCK: libc::c_ulong = 14;
    // SAFETY: only async-signal-safe system calls between fork and exec.
    unsafe {
        cmd.pre_exec(move || {
            let none: libc::c_ulong = 0;
            if libc::prctl(libc::PR_CAPBSET_DROP, CAP_IPC_LOCK, none, none, none) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Ambient capabilities would survive the exec: none.
            let clear = libc::PR_CAP_AMBIENT_CLEAR_ALL as libc::c_ulong;
            if libc::prctl(libc::PR_CAP_AMBIENT, clear, none, none, none) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            let limit = libc::rlimit {
                rlim_cur: bytes,
                rlim_max: bytes,
            };
            if libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
