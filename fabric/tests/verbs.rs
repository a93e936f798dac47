//! Tests that need real hardware paths, run for real inside the VM of `scripts/vm-tests.sh`
//! (Soft-RoCE device rxe0, DAX-mounted pmem at /run/pm):
//! - the conformance suite over the verbs backend (VerbsNic / VerbsFabric on the first RDMA
//!   device, or `DINOMO_RDMA_DEVICE`);
//! - a DAX region in `DINOMO_PM_DIR` (MAP_SYNC + CLWB/CLFLUSHOPT persistence), and the
//!   conformance suite over the shm backend on a pool in that directory.
//!
//! Outside the VM these skip with a printed line when there is no RDMA device or no
//! `DINOMO_PM_DIR`. Inside it (`DINOMO_VM=1`) a missing device or directory is a failure.
#![cfg(feature = "rdma")]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use dinomo_fabric::conformance::{run_all, Harness};
use dinomo_fabric::grants::{GrantTable, WindowRange};
use dinomo_fabric::shm::ShmFabric;
use dinomo_fabric::verbs::{self, VerbsFabric, VerbsNic};
use dinomo_fabric::{
    AccessKey, Durability, DurabilityRequest, Fabric, FabricError, FabricExt, PmRegion,
};

const LEN: u64 = 8 << 20;

fn in_vm() -> bool {
    std::env::var("DINOMO_VM").is_ok_and(|v| v == "1")
}

/// Returns true if the test should run; prints why it skips otherwise; panics in the VM.
fn require(what: &str, present: bool) -> bool {
    if present {
        return true;
    }
    assert!(
        !in_vm(),
        "DINOMO_VM=1 but {what}: inside the test VM this must not be skipped"
    );
    println!("SKIPPED: {what} (not in the test VM; scripts/vm-tests.sh runs this for real)");
    false
}

struct Node {
    _dir: Option<tempfile::TempDir>,
    pool: PathBuf,
    region: Arc<PmRegion>,
    grants: Arc<GrantTable>,
}

impl Node {
    fn in_dir(dir: &Path, request: DurabilityRequest) -> Self {
        let pool = dir.join(format!("conformance-{}.pool", std::process::id()));
        let region = Arc::new(PmRegion::create(&pool, LEN, request).unwrap());
        let grants = Arc::new(GrantTable::create(&GrantTable::path_for(&pool), 64).unwrap());
        Node {
            _dir: None,
            pool,
            region,
            grants,
        }
    }

    fn temp() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let mut n = Node::in_dir(dir.path(), DurabilityRequest::Auto);
        n._dir = Some(dir);
        n
    }

    fn local_read(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.region.read(offset, &mut v).unwrap();
        v
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if self._dir.is_none() {
            let _ = std::fs::remove_file(&self.pool);
            let _ = std::fs::remove_file(GrantTable::path_for(&self.pool));
        }
    }
}

/// The node, its NIC, and every handle the suite connected (to count device refusals).
struct Verbs(Node, VerbsNic, std::sync::Mutex<Vec<Arc<VerbsFabric>>>);

impl Verbs {
    fn new(node: Node, nic: VerbsNic) -> Self {
        Verbs(node, nic, std::sync::Mutex::new(Vec::new()))
    }

    /// Requests the device refused, over every handle the suite connected.
    fn device_refusals(&self) -> u64 {
        self.2
            .lock()
            .unwrap()
            .iter()
            .map(|f| f.device_refusals())
            .sum()
    }
}

#[async_trait]
impl Harness for Verbs {
    fn region_len(&self) -> u64 {
        LEN
    }
    async fn connect_with(
        &self,
        window: &[WindowRange],
    ) -> dinomo_fabric::Result<(Box<dyn Fabric>, AccessKey)> {
        let key = self.0.grants.grant_with_window(window)?;
        let f = Arc::new(VerbsFabric::connect(self.1.local_addr(), key).await?);
        self.2.lock().unwrap().push(f.clone());
        Ok((Box::new(f), key))
    }
    fn revoke(&self, key: AccessKey) {
        self.1.revoke(key);
    }
    /// Through the NIC, as the DPM's SealSegment does (its key fence): the window MRs of the
    /// range are deregistered when this returns.
    fn close_window(&self, key: AccessKey, offset: u64) {
        self.1.close_window(key, offset).unwrap();
    }
    fn local_read(&self, offset: u64, len: usize) -> Vec<u8> {
        self.0.local_read(offset, len)
    }
}

struct Shm(Node);

#[async_trait]
impl Harness for Shm {
    fn region_len(&self) -> u64 {
        LEN
    }
    async fn connect_with(
        &self,
        window: &[WindowRange],
    ) -> dinomo_fabric::Result<(Box<dyn Fabric>, AccessKey)> {
        let key = self.0.grants.grant_with_window(window)?;
        // A KN maps the pool anew; on a DAX mount this is MAP_SYNC + cache-line write-back.
        let f = ShmFabric::connect(&self.0.pool, key, DurabilityRequest::Dax)?;
        assert!(
            matches!(f.region().durability(), Durability::Dax(_)),
            "the shm caller must map with DAX"
        );
        Ok((Box::new(f), key))
    }
    fn revoke(&self, key: AccessKey) {
        self.0.grants.revoke(key).unwrap();
    }
    fn close_window(&self, key: AccessKey, offset: u64) {
        self.0.grants.close_window(key, offset).unwrap();
    }
    fn local_read(&self, offset: u64, len: usize) -> Vec<u8> {
        self.0.local_read(offset, len)
    }
}

fn rdma_present() -> bool {
    let devs = verbs::device_names();
    if !devs.is_empty() {
        println!("RDMA devices: {devs:?}");
    }
    require("no RDMA device is present", !devs.is_empty())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_verbs() {
    if !rdma_present() {
        return;
    }
    let node = Node::temp();
    let nic = VerbsNic::start(
        "127.0.0.1:0".parse().unwrap(),
        node.region.clone(),
        node.grants.clone(),
    )
    .await
    .unwrap();
    println!("verbs NIC on {} at {}", nic.device(), nic.local_addr());
    let h = Verbs::new(node, nic);
    let ran = run_all(&h).await.unwrap_or_else(|e| panic!("verbs: {e}"));
    println!(
        "verbs conformance passed: {ran:?}; device refusals: {}",
        h.device_refusals()
    );
    assert_eq!(ran.len(), 9);
    // The window case closes the segment while a writer posts through its region: the writer's
    // next WRITE goes out with the stale rkey and the device refuses it (the writer cannot
    // finish its 8191 WRITEs in the 5 ms before the close). The handle then went on.
    assert!(
        h.device_refusals() >= 1,
        "the race with the window's close never reached the device"
    );
}

/// Checks beyond the shared suite: the handshake refuses bad keys, the backend's name, a
/// caller fenced through the grant table alone (the node's watcher), and a big batch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_handshake_and_table_revocation() {
    if !rdma_present() {
        return;
    }
    let node = Node::temp();
    let nic = VerbsNic::start(
        "127.0.0.1:0".parse().unwrap(),
        node.region.clone(),
        node.grants.clone(),
    )
    .await
    .unwrap();
    let bogus = AccessKey {
        slot: 1,
        generation: 1,
        secret: [7; 16],
    };
    let r = VerbsFabric::connect(nic.local_addr(), bogus).await;
    assert!(
        matches!(r, Err(FabricError::AccessDenied { slot: 1 })),
        "{r:?}"
    );

    let key = node
        .grants
        .grant_with_window(&[WindowRange::write(4096, 4096)])
        .unwrap();
    let f = VerbsFabric::connect(nic.local_addr(), key).await.unwrap();
    assert_eq!(f.backend(), "verbs");
    assert_eq!(f.region_len(), LEN);

    // More work requests than one doorbell takes: still one post, in order.
    let ops: Vec<_> = (0..300u64)
        .map(|i| dinomo_fabric::Op::Write {
            offset: 4096 + i * 8,
            data: Bytes::copy_from_slice(&i.to_le_bytes()),
        })
        .collect();
    let before = f.stats().snapshot();
    f.post(&ops).await.unwrap();
    let d = f.stats().snapshot().since(&before);
    assert_eq!(
        (d.round_trips, d.writes, d.reads),
        (1, 300, 0),
        "the durability READs are hidden"
    );
    for i in [0u64, 255, 256, 299] {
        assert_eq!(node.local_read(4096 + i * 8, 8), i.to_le_bytes());
    }

    // Revoked in the table only (another process, say): the watcher fences the MR.
    node.grants.revoke(key).unwrap();
    tokio::time::sleep(verbs::REVOKE_POLL * 3).await;
    let r = f.read(0, 8).await;
    assert!(matches!(r, Err(FabricError::AccessDenied { .. })), "{r:?}");
    let r = f.read(0, 8).await;
    assert!(
        matches!(r, Err(FabricError::AccessDenied { .. })),
        "a fenced handle stays fenced: {r:?}"
    );
}

fn pattern(len: usize, seed: u8) -> Bytes {
    Bytes::from(
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13).wrapping_add(seed))
            .collect::<Vec<_>>(),
    )
}

/// Write windows beyond the shared suite (which closes ranges through the NIC): a range opened
/// after the handshake is learnt at the first WRITE there; a range closed in the grant table
/// alone loses its memory region within the watcher's poll, after which the device itself
/// refuses the caller's stale rkey (the caller never learnt of the close): reported as
/// OutsideWindow when nothing of the post was applied, as WindowClosedDuringPost when an
/// earlier WRITE of the post was, and the handle goes on with its new window.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_window_regions_follow_the_grant_table() {
    if !rdma_present() {
        return;
    }
    let node = Node::temp();
    let nic = VerbsNic::start(
        "127.0.0.1:0".parse().unwrap(),
        node.region.clone(),
        node.grants.clone(),
    )
    .await
    .unwrap();
    let (max_mr, max_pd) = nic.device_limits();
    println!(
        "verbs device {}: max_mr {max_mr}, max_pd {max_pd}; a connection takes 1 PD and up to {} MRs",
        nic.device(),
        1 + dinomo_fabric::grants::MAX_WINDOW_RANGES
    );
    const W: u64 = 64 << 10;
    let (a, b, c) = (1u64 << 20, 2u64 << 20, 3u64 << 20);
    let key = node
        .grants
        .grant_with_window(&[WindowRange::write(a, W)])
        .unwrap();
    let f = VerbsFabric::connect(nic.local_addr(), key).await.unwrap();
    f.write(a, pattern(4096, 1)).await.unwrap();
    assert_eq!(node.local_read(a, 4096), pattern(4096, 1)[..]);

    // Not in the window yet: refused before anything is posted.
    let r = f.write(b, pattern(64, 2)).await;
    assert!(
        matches!(r, Err(FabricError::OutsideWindow { offset, len: 64, .. }) if offset == b),
        "{r:?}"
    );
    assert_eq!(node.local_read(b, 64), vec![0; 64]);
    // Opened in the table after the handshake: the next WRITE asks for its region.
    node.grants
        .open_window(key, WindowRange::write(b, W))
        .unwrap();
    node.grants
        .open_window(key, WindowRange::write(c, W))
        .unwrap();
    f.write(b, pattern(64, 2)).await.unwrap();
    f.write(c, pattern(64, 3)).await.unwrap();
    assert_eq!(node.local_read(b, 64), pattern(64, 2)[..]);
    assert_eq!(node.local_read(c, 64), pattern(64, 3)[..]);

    // Closed in the table alone: within the watcher's poll the region is gone, and the device
    // refuses the WRITE the caller still posts through it.
    node.grants.close_window(key, a).unwrap();
    tokio::time::sleep(verbs::REVOKE_POLL * 3).await;
    let before = node.local_read(a, 4096);
    assert_eq!(
        f.device_refusals(),
        0,
        "every refusal so far was the caller's own"
    );
    let r = f.write(a, pattern(4096, 4)).await;
    assert_eq!(f.device_refusals(), 1, "the device refused the stale rkey");
    assert!(
        matches!(r, Err(FabricError::OutsideWindow { offset, .. }) if offset == a),
        "a WRITE through a deregistered region, first in its post: {r:?}"
    );
    assert_eq!(node.local_read(a, 4096), before, "the refused WRITE landed");
    // The handle restarted: READ anywhere and WRITE in the open ranges work.
    assert_eq!(f.read(a, 4096).await.unwrap(), before);
    f.write(b + 64, pattern(64, 5)).await.unwrap();
    assert_eq!(node.local_read(b + 64, 64), pattern(64, 5)[..]);
    // Again, with a WRITE inside the window first in the post: that one is applied, so the
    // post's outcome is unknown, never done.
    node.grants.close_window(key, c).unwrap();
    tokio::time::sleep(verbs::REVOKE_POLL * 3).await;
    let r = f
        .post(&[
            dinomo_fabric::Op::Write {
                offset: b + 128,
                data: pattern(64, 6),
            },
            dinomo_fabric::Op::Write {
                offset: c,
                data: pattern(64, 7),
            },
        ])
        .await;
    assert!(
        matches!(r, Err(FabricError::WindowClosedDuringPost { offset, .. }) if offset == c),
        "{r:?}"
    );
    assert_eq!(node.local_read(c, 64), pattern(64, 3)[..], "c is unchanged");
    assert_eq!(f.device_refusals(), 2);
    // Now the caller knows: refused locally.
    let r = f.write(c, pattern(64, 8)).await;
    assert!(matches!(r, Err(FabricError::OutsideWindow { .. })), "{r:?}");
    assert_eq!(f.device_refusals(), 2);
    f.write(b + 256, pattern(8, 9)).await.unwrap();

    // Revoked in the table alone: the watcher takes every region; the next post is refused at
    // the device and the restart learns the key is gone, for good.
    node.grants.revoke(key).unwrap();
    tokio::time::sleep(verbs::REVOKE_POLL * 3).await;
    let r = f.write(b, pattern(8, 10)).await;
    assert!(matches!(r, Err(FabricError::AccessDenied { .. })), "{r:?}");
    let r = f.read(0, 8).await;
    assert!(matches!(r, Err(FabricError::AccessDenied { .. })), "{r:?}");
    assert_eq!(node.local_read(b, 8), pattern(64, 2)[..8]);
    println!(
        "verbs: window regions follow the grant table (device refusals reported, handle restarted)"
    );
}

fn pm_dir() -> Option<PathBuf> {
    std::env::var_os("DINOMO_PM_DIR")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

#[test]
fn dax_region_persists_with_cache_line_write_back() {
    let dir = pm_dir();
    if !require("DINOMO_PM_DIR is not set (no DAX mount)", dir.is_some()) {
        return;
    }
    let dir = dir.unwrap();
    let path = dir.join(format!("dax-check-{}.pm", std::process::id()));
    {
        let r = PmRegion::create(&path, 1 << 20, DurabilityRequest::Dax)
            .unwrap_or_else(|e| panic!("a DAX region in {}: {e}", dir.display()));
        let d = r.durability();
        println!("DAX region in {}: {d}", dir.display());
        assert!(matches!(d, Durability::Dax(_)), "durability is {d:?}");
        let data: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        r.write_durable(4097, &data).unwrap();
        r.word(64)
            .unwrap()
            .store(0xfeed, std::sync::atomic::Ordering::SeqCst);
        r.persist(64, 8).unwrap();
        let mut back = vec![0; data.len()];
        r.read(4097, &mut back).unwrap();
        assert_eq!(back, data);
    }
    // Mapped anew (as after a restart), the bytes are there.
    let r = PmRegion::open(&path, DurabilityRequest::Dax).unwrap();
    let mut w = [0u8; 8];
    r.read(64, &mut w).unwrap();
    assert_eq!(u64::from_le_bytes(w), 0xfeed);
    drop(r);
    std::fs::remove_file(&path).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_shm_on_dax() {
    let dir = pm_dir();
    if !require("DINOMO_PM_DIR is not set (no DAX mount)", dir.is_some()) {
        return;
    }
    let node = Node::in_dir(&dir.unwrap(), DurabilityRequest::Dax);
    assert!(matches!(node.region.durability(), Durability::Dax(_)));
    let ran = run_all(&Shm(node))
        .await
        .unwrap_or_else(|e| panic!("shm on DAX: {e}"));
    println!("shm conformance on DAX passed: {ran:?}");
    assert_eq!(ran.len(), 9);
}

/// Whether the verbs backend can serve a region that lives on DAX: registering a file mapping
/// pins its pages, which fsdax refuses on many kernels. Reports what happens; it fails only if
/// registration succeeds and the suite then fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verbs_on_dax_region_probe() {
    let Some(dir) = pm_dir() else {
        println!("SKIPPED: DINOMO_PM_DIR is not set (the dax tests above report this)");
        return;
    };
    if verbs::device_names().is_empty() {
        println!("SKIPPED: no RDMA device is present (conformance_verbs reports this)");
        return;
    }
    let node = Node::in_dir(&dir, DurabilityRequest::Dax);
    let nic = VerbsNic::start(
        "127.0.0.1:0".parse().unwrap(),
        node.region.clone(),
        node.grants.clone(),
    )
    .await
    .unwrap();
    let key = node.grants.grant().unwrap();
    match VerbsFabric::connect(nic.local_addr(), key).await {
        Err(e) => println!("PROBE: verbs cannot register a DAX region on this kernel: {e}"),
        Ok(f) => {
            drop(f);
            let ran = run_all(&Verbs::new(node, nic))
                .await
                .unwrap_or_else(|e| panic!("verbs on DAX: {e}"));
            println!("PROBE: verbs conformance on a DAX region passed: {ran:?}");
        }
    }
}
