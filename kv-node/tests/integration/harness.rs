//! Test harness: a dpm-node in this process (its library's server), kv-node processes (the
//! real binary), gRPC clients, and publishing cluster maps. For tests that must reach into a
//! KN: in-process KNs (the library) over fault-injecting fabrics, and a proxy that can cut a
//! KN's control link to the DPM while its fabric keeps working.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::Duration;

use dinomo_fabric::fault::Faulty;
use dinomo_kv_node::config::KnConfigFile;
use dinomo_kv_node::node::FabricHook;
use dinomo_kv_node::KvNode;

use dinomo_dpm_node::config::DpmConfigFile;
use dinomo_dpm_node::testkit::InProcessDpm;
use dinomo_placement::ClusterMap;
use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use dinomo_proto::dpm::{CompareAndPutMetadataRequest, GetMetadataRequest};
use dinomo_proto::kv::kv_service_client::KvServiceClient;
use tonic::transport::Channel;

/// The in-process dpm-node ([`InProcessDpm`]) with a small pool, and what these tests ask of it.
#[derive(Debug)]
pub struct InProcDpm {
    pub grpc: SocketAddr,
    inner: InProcessDpm,
}

impl InProcDpm {
    pub async fn start(dir: &Path, segment_size: &str) -> Self {
        let cfg = DpmConfigFile {
            pool_size: "256MiB".parse().unwrap(),
            segment_size: segment_size.parse().unwrap(),
            gc_interval_ms: 20,
            ..DpmConfigFile::in_process(dir.join("pool"))
        }
        .validate()
        .unwrap();
        let inner = tokio::time::timeout(Duration::from_secs(20), InProcessDpm::start(cfg))
            .await
            .expect("the in-process dpm-node was not ready within 20 s")
            .unwrap();
        InProcDpm {
            grpc: inner.grpc(),
            inner,
        }
    }

    pub fn url(&self) -> String {
        self.inner.url()
    }

    pub async fn client(&self) -> DpmServiceClient<Channel> {
        DpmServiceClient::connect(self.url()).await.unwrap()
    }

    /// Publishes `map` over the published one, as a monitor does (CompareAndPutMetadata: the
    /// DPM takes nothing else for the map, and only its next version).
    pub async fn publish_map(&self, map: &ClusterMap) {
        let mut c = self.client().await;
        let expected = c
            .get_metadata(GetMetadataRequest {
                name: "cluster/map".into(),
            })
            .await
            .unwrap()
            .into_inner()
            .value;
        c.compare_and_put_metadata(CompareAndPutMetadataRequest {
            name: "cluster/map".into(),
            value: Some(map.encode()),
            expected,
        })
        .await
        .unwrap();
    }

    pub async fn stop(self) {
        let _ = self.inner.stop().await;
    }
}

#[derive(Debug)]
pub struct KnProcess {
    child: Child,
    pub addr: SocketAddr,
}

impl KnProcess {
    pub fn start(dpm: &InProcDpm, kn_id: u32, log: &Path, extra: &[&str]) -> Self {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_kv-node"));
        // Plain text: these tests are about the node, not TLS (cli's security tests are).
        cmd.env("DINOMO_INSECURE", "1");
        cmd.args([
            "--kn-id",
            &kn_id.to_string(),
            "--listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "",
            "--dpm",
        ])
        .arg(dpm.grpc.to_string())
        .args(extra)
        .arg("--print-ready");
        let (child, line) =
            dinomo_node_common::spawn_until_ready("kv-node", cmd, log, Duration::from_secs(30))
                .unwrap_or_else(|e| {
                    panic!(
                        "{e}; log: {}",
                        std::fs::read_to_string(log).unwrap_or_default()
                    )
                });
        let addr = dinomo_node_common::ready_field(&line, "addr=")
            .and_then(|a| a.parse().ok())
            .expect("READY line has addr=");
        KnProcess { child, addr }
    }

    pub async fn client(&self) -> KvServiceClient<Channel> {
        KvServiceClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
    }

    /// SIGTERM (a clean stop) and waits, bounded, for the process to exit.
    pub fn terminate(&mut self, within: Duration) -> std::process::ExitStatus {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let start = std::time::Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                start.elapsed() < within,
                "kv-node did not stop within {within:?}"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for KnProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Waits until `f` is true (bounded).
pub async fn eventually(what: &str, mut f: impl AsyncFnMut() -> bool) {
    let start = std::time::Instant::now();
    while !f().await {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Each shard's fabric of an in-process KN, wrapped so a test can fail, delay or tear its posts.
pub type FaultyFabrics = Arc<parking_lot::Mutex<Vec<Arc<Faulty<Arc<dyn dinomo_fabric::Fabric>>>>>>;

/// A kv-node in this process (the library, no gRPC server), so a test can reach into it: its
/// shards' fabrics are [`Faulty`] (see the returned handles) and `dpm` may be a [`GrpcProxy`].
/// One shard, so every key shares one log; the serve lease is long (tests drive maps by hand).
pub async fn start_inproc_kn(dpm: &str, kn_id: u32) -> (Arc<KvNode>, FaultyFabrics) {
    let cfg = KnConfigFile {
        advertise: format!("127.0.0.1:{}", 17000 + kn_id),
        shards: 1,
        cache_size: "16MiB".parse().unwrap(),
        map_poll_ms: 100,
        ..KnConfigFile::in_process(kn_id, dpm.to_string())
    }
    .validate()
    .unwrap();
    // Longer than a config may say (lease::MAX_SERVE_LEASE): these tests drive maps by hand.
    let mut cfg = cfg;
    cfg.serve_lease = Duration::from_secs(60);
    let fabrics: FaultyFabrics = Default::default();
    let f = fabrics.clone();
    let hook: FabricHook = Arc::new(move |_shard, inner| {
        let faulty = Arc::new(Faulty::new(inner));
        f.lock().push(faulty.clone());
        faulty as Arc<dyn dinomo_fabric::Fabric>
    });
    let node = KvNode::start_with(cfg, Some(hook)).await.unwrap();
    (node, fabrics)
}

/// A TCP proxy in front of the DPM's gRPC port that a test can cut (every connection is closed
/// and new ones are refused) and restore: the KN's control calls fail, its fabric does not.
#[derive(Debug)]
pub struct GrpcProxy {
    pub addr: SocketAddr,
    cut: tokio::sync::watch::Sender<bool>,
}

impl GrpcProxy {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (cut, cut_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                if *cut_rx.borrow() {
                    continue; // dropped: refused
                }
                let mut cut_rx = cut_rx.clone();
                tokio::spawn(async move {
                    let Ok(mut up) = tokio::net::TcpStream::connect(target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut down, &mut up) => {}
                        _ = cut_rx.wait_for(|c| *c) => {}
                    }
                });
            }
        });
        GrpcProxy { addr, cut }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set_cut(&self, cut: bool) {
        self.cut.send_replace(cut);
    }
}

/// This KN's segments that the DPM has not merged yet (open ones included).
pub async fn pending_segments(dpm: &InProcDpm, kn: u32) -> Vec<u64> {
    dpm.client()
        .await
        .pending_segments(dinomo_proto::dpm::PendingSegmentsRequest { kn_id: kn })
        .await
        .unwrap()
        .into_inner()
        .pending_ids
}

/// MergeAll of one KN's log at the DPM (what a reconfiguration does before the keys move);
/// `seal_open`: seal its open segments first (the KN could not).
pub async fn merge_all(dpm: &InProcDpm, kn: u32, seal_open: bool) {
    dpm.client()
        .await
        .merge_all(dinomo_proto::dpm::MergeAllRequest {
            kn_id: kn,
            seal_open,
        })
        .await
        .unwrap();
}
