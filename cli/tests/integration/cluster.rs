//! A cluster harness: spawns the real nodes (this package's `dinomo` binary) on loopback ports
//! chosen by the OS, publishes maps, adds, removes and kills KV nodes.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dinomo_client::{admin, Client, ClientConfig};
use dinomo_placement::{ClusterMap, KnInfo};

pub struct Proc {
    child: Child,
    pub addr: String,
}

impl Proc {
    fn spawn(args: &[&str], log: &Path, field: &str) -> Proc {
        let stderr = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .unwrap();
        let mut child = Command::new(env!("CARGO_BIN_EXE_dinomo"))
            .args(args)
            .arg("--print-ready")
            .env("DINOMO_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(stderr)
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
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
                    "{args:?} not ready: {}",
                    std::fs::read_to_string(log).unwrap_or_default()
                )
            });
        let addr = line
            .split_whitespace()
            .find_map(|w| w.strip_prefix(field))
            .unwrap_or_else(|| panic!("no {field} in {line:?}"))
            .to_string();
        Proc { child, addr }
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn stop(&mut self) {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let _ = self.child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub struct Cluster {
    pub dir: tempfile::TempDir,
    pub dpm: Proc,
    pub kns: BTreeMap<u32, Proc>,
    pub routing: Proc,
}

impl Cluster {
    fn log(&self, name: &str) -> PathBuf {
        self.dir.path().join(format!("{name}.log"))
    }

    /// A dpm-node, `n` KV nodes (ids 0..n) under a published map, and a routing node.
    pub async fn start(n: u32) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().join("pool");
        let dpm = Proc::spawn(
            &[
                "dpm-node",
                "--pool",
                pool.to_str().unwrap(),
                "--pool-size",
                "256MiB",
                "--listen",
                "127.0.0.1:0",
                "--fabric-listen",
                "127.0.0.1:0",
                "--metrics-listen",
                "",
            ],
            &dir.path().join("dpm.log"),
            "grpc=",
        );
        let routing = Proc::spawn(
            &[
                "routing-node",
                "--listen",
                "127.0.0.1:0",
                "--dpm",
                &dpm.addr,
                "--metrics-listen",
                "",
                "--poll-ms",
                "20",
            ],
            &dir.path().join("routing.log"),
            "addr=",
        );
        let mut c = Cluster {
            dir,
            dpm,
            kns: BTreeMap::new(),
            routing,
        };
        let mut infos = Vec::new();
        for id in 0..n {
            let p = c.spawn_kn(id);
            infos.push(KnInfo {
                id,
                endpoint: p.addr.clone(),
            });
            c.kns.insert(id, p);
        }
        admin::publish_map(&c.dpm.addr, &ClusterMap::new(infos, 64, 2).unwrap())
            .await
            .unwrap();
        c
    }

    fn spawn_kn(&self, id: u32) -> Proc {
        Proc::spawn(
            &[
                "kv-node",
                "--kn-id",
                &id.to_string(),
                "--listen",
                "127.0.0.1:0",
                "--dpm",
                &self.dpm.addr,
                "--metrics-listen",
                "",
                "--cache-size",
                "1MiB",
            ],
            &self.log(&format!("kn{id}")),
            "addr=",
        )
    }

    pub async fn client(&self) -> Client {
        let mut cfg = ClientConfig::new(&[&self.routing.addr]);
        cfg.deadline = Duration::from_secs(20);
        Client::connect_with(cfg).await.unwrap()
    }

    pub async fn map(&self) -> ClusterMap {
        admin::published_map(&self.dpm.addr)
            .await
            .unwrap()
            .expect("a published map")
    }

    /// Starts KN `id` and moves the cluster to a map that includes it.
    pub async fn add_kn(&mut self, id: u32) -> admin::ReconfigReport {
        let p = self.spawn_kn(id);
        let cur = self.map().await;
        let next = cur
            .with_kn_added(KnInfo {
                id,
                endpoint: p.addr.clone(),
            })
            .unwrap();
        self.kns.insert(id, p);
        admin::reconfigure(&self.dpm.addr, &cur, &next)
            .await
            .unwrap()
    }

    /// Moves the cluster to a map without KN `id` (graceful if it runs, failover if it died),
    /// then stops its process.
    pub async fn remove_kn(&mut self, id: u32) -> admin::ReconfigReport {
        let cur = self.map().await;
        let next = cur.with_kn_removed(id).unwrap();
        let r = admin::reconfigure(&self.dpm.addr, &cur, &next)
            .await
            .unwrap();
        if let Some(mut p) = self.kns.remove(&id) {
            // Drain before stopping, as an orchestrator does: clients still on the old map get
            // WRONG_OWNER from it and move on; a request cut off by the shutdown itself would
            // have an unknown outcome for its client.
            tokio::time::sleep(Duration::from_millis(500)).await;
            p.stop();
        }
        r
    }
}
