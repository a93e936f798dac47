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

struct Verbs(Node, VerbsNic);

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
        let f = VerbsFabric::connect(self.1.local_addr(), key).await?;
        Ok((Box::new(f), key))
    }
    fn revoke(&self, key: AccessKey) {
        self.1.revoke(key);
    }
    fn close_window(&self, key: AccessKey, offset: u64) {
        self.0.grants.close_window(key, offset).unwrap();
    }
    /// The verbs write MR still covers the whole region (per-segment MRs are a later step).
    fn enforces_windows(&self) -> bool {
        false
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
    let h = Verbs(node, nic);
    let ran = run_all(&h).await.unwrap_or_else(|e| panic!("verbs: {e}"));
    println!("verbs conformance passed: {ran:?}");
    assert_eq!(ran.len(), 8);
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

    let key = node.grants.grant().unwrap();
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
            let ran = run_all(&Verbs(node, nic))
                .await
                .unwrap_or_else(|e| panic!("verbs on DAX: {e}"));
            println!("PROBE: verbs conformance on a DAX region passed: {ran:?}");
        }
    }
}
