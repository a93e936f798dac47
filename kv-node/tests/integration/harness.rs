//! Test harness: a dpm-node in this process (its library's server), kv-node processes (the
//! real binary), gRPC clients, and publishing cluster maps.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use dinomo_dpm_node::config::DpmConfigFile;
use dinomo_placement::ClusterMap;
use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use dinomo_proto::dpm::PutMetadataRequest;
use dinomo_proto::kv::kv_service_client::KvServiceClient;
use tonic::transport::Channel;

#[derive(Debug)]
pub struct InProcDpm {
    pub grpc: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl InProcDpm {
    pub async fn start(dir: &Path, segment_size: &str) -> Self {
        let cfg = DpmConfigFile {
            pool_path: dir.join("pool"),
            pool_size: "256MiB".into(),
            segment_size: segment_size.into(),
            listen: "127.0.0.1:0".into(),
            fabric_listen: "127.0.0.1:0".into(),
            metrics_listen: String::new(),
            gc_interval_ms: 20,
            ..Default::default()
        }
        .validate()
        .unwrap();
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut ready_tx = Some(ready_tx);
            dinomo_dpm_node::server::run(
                cfg,
                async move {
                    let _ = stop_rx.await;
                },
                move |r| {
                    let _ = ready_tx.take().expect("once").send(r.grpc);
                },
            )
            .await
            .unwrap();
        });
        let grpc = tokio::time::timeout(Duration::from_secs(20), ready_rx)
            .await
            .unwrap()
            .unwrap();
        InProcDpm {
            grpc,
            stop: Some(stop_tx),
            task: Some(task),
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.grpc)
    }

    pub async fn client(&self) -> DpmServiceClient<Channel> {
        DpmServiceClient::connect(self.url()).await.unwrap()
    }

    pub async fn publish_map(&self, map: &ClusterMap) {
        self.client()
            .await
            .put_metadata(PutMetadataRequest {
                name: "cluster/map".into(),
                value: Some(map.encode()),
            })
            .await
            .unwrap();
    }

    pub async fn stop(mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

#[derive(Debug)]
pub struct KnProcess {
    child: Child,
    pub addr: SocketAddr,
}

impl KnProcess {
    pub fn start(dpm: &InProcDpm, kn_id: u32, log: &Path, extra: &[&str]) -> Self {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_kv-node"))
            .args([
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
            .arg("--print-ready")
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("spawning kv-node");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if line.starts_with("READY") {
                    let _ = tx.send(line);
                }
            }
        });
        let line = rx
            .recv_timeout(Duration::from_secs(30))
            .unwrap_or_else(|_| {
                let _ = child.kill();
                panic!(
                    "kv-node did not become ready: {}",
                    std::fs::read_to_string(log).unwrap_or_default()
                )
            });
        let addr = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix("addr="))
            .and_then(|a| a.parse().ok())
            .expect("READY line has addr=");
        KnProcess { child, addr }
    }

    pub async fn client(&self) -> KvServiceClient<Channel> {
        KvServiceClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
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
