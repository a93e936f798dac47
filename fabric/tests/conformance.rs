//! The conformance suite over the shm and tcp backends (verbs runs it in the VM: see
//! tests/verbs in this crate and scripts/softroce-vm.sh).

use std::sync::Arc;

use async_trait::async_trait;
use dinomo_fabric::conformance::{run_all, Harness};
use dinomo_fabric::grants::{GrantTable, WindowRange};
use dinomo_fabric::shm::ShmFabric;
use dinomo_fabric::tcp::{TcpFabric, TcpNic};
use dinomo_fabric::{AccessKey, DurabilityRequest, Fabric, PmRegion};

const LEN: u64 = 8 << 20;

struct Node {
    _dir: tempfile::TempDir,
    pool: std::path::PathBuf,
    region: Arc<PmRegion>,
    grants: Arc<GrantTable>,
}

impl Node {
    fn new() -> Self {
        Self::with(DurabilityRequest::Auto)
    }

    fn with(durability: DurabilityRequest) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().join("pool");
        let region = Arc::new(PmRegion::create(&pool, LEN, durability).unwrap());
        let grants = Arc::new(GrantTable::create(&GrantTable::path_for(&pool), 64).unwrap());
        Node {
            _dir: dir,
            pool,
            region,
            grants,
        }
    }

    fn local_read(&self, offset: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0; len];
        self.region.read(offset, &mut v).unwrap();
        v
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
        // Maps the pool and the grant table anew, as a KN process does.
        let f = ShmFabric::connect(&self.0.pool, key, DurabilityRequest::Auto)?;
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

struct Tcp(Node, TcpNic);

#[async_trait]
impl Harness for Tcp {
    fn region_len(&self) -> u64 {
        LEN
    }
    async fn connect_with(
        &self,
        window: &[WindowRange],
    ) -> dinomo_fabric::Result<(Box<dyn Fabric>, AccessKey)> {
        let key = self.0.grants.grant_with_window(window)?;
        let f = TcpFabric::connect(self.1.local_addr(), key).await?;
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_shm() {
    let ran = run_all(&Shm(Node::new()))
        .await
        .unwrap_or_else(|e| panic!("shm: {e}"));
    assert_eq!(ran.len(), 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_tcp() {
    let node = Node::new();
    let nic = TcpNic::start(
        "127.0.0.1:0".parse().unwrap(),
        node.region.clone(),
        node.grants.clone(),
    )
    .await
    .unwrap();
    let ran = run_all(&Tcp(node, nic))
        .await
        .unwrap_or_else(|e| panic!("tcp: {e}"));
    assert_eq!(ran.len(), 9);
}

/// The tcp NIC over a region that records persisted lines: the suite passes, and afterwards
/// nothing it did is only in the page cache (a completed operation is durable), so a power
/// failure now would lose nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_tcp_leaves_nothing_unpersisted() {
    let node = Node::with(DurabilityRequest::SimulatedPowerLoss);
    let region = node.region.clone();
    let nic = TcpNic::start(
        "127.0.0.1:0".parse().unwrap(),
        region.clone(),
        node.grants.clone(),
    )
    .await
    .unwrap();
    let ran = run_all(&Tcp(node, nic))
        .await
        .unwrap_or_else(|e| panic!("tcp over simulated power loss: {e}"));
    assert_eq!(ran.len(), 9);
    assert!(region.persist_count() > 0);
    for seed in 0..4 {
        let image = region.power_loss_image(seed).unwrap();
        assert_eq!(image.stats.differing, 0, "{:?}", image.stats);
    }
}
