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
    pub(crate) fn spawn(args: &[&str], log: &Path, field: &str) -> Proc {
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

/// A dpm-node (pool in `dir`) and a routing node polling it every 20 ms, on OS-chosen ports.
pub(crate) fn dpm_and_routing(dir: &Path) -> (Proc, Proc) {
    let pool = dir.join("pool");
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
        &dir.join("dpm.log"),
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
        &dir.join("routing.log"),
        "addr=",
    );
    (dpm, routing)
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
        let (dpm, routing) = dpm_and_routing(dir.path());
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

/// A base port such that `base + 1 ..= base + n` are all free right now (the local
/// orchestrator puts KN i on `base + i`).
fn free_port_base(n: u16) -> u16 {
    for _ in 0..200 {
        let base = 20_000 + rand::random_range(0..30_000u16);
        let ok = (1..=n).all(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok());
        if ok {
            return base;
        }
    }
    panic!("no free range of {n} ports");
}

/// A cluster run by the monitor: a dpm-node, a routing node and `dinomo monitor` with the local
/// orchestrator, which starts the KV nodes (ids 1..=n) and publishes the map.
pub struct MonitoredCluster {
    pub dir: tempfile::TempDir,
    pub dpm: Proc,
    pub routing: Proc,
    pub monitor: Proc,
    /// KN i listens on 127.0.0.1:(kn_port_base + i).
    pub kn_port_base: u16,
}

impl MonitoredCluster {
    /// `config` is the monitor's TOML config (its [server] listen/dpm are set by flags).
    pub async fn start(n: u32, config: &str) -> MonitoredCluster {
        let dir = tempfile::tempdir().unwrap();
        let (dpm, routing) = dpm_and_routing(dir.path());
        let cfg_path = dir.path().join("monitor.toml");
        std::fs::write(&cfg_path, config).unwrap();
        let base = free_port_base(16);
        let monitor = Proc::spawn(
            &[
                "monitor",
                "--config",
                cfg_path.to_str().unwrap(),
                "--listen",
                "127.0.0.1:0",
                "--dpm",
                &dpm.addr,
                "--metrics-listen",
                "",
                "--routing",
                &routing.addr,
                "--kns",
                &n.to_string(),
                "--kn-port-base",
                &base.to_string(),
                "--kn-arg=--cache-size",
                "--kn-arg=1MiB",
                "--kn-arg=--shards",
                "--kn-arg=2",
                "--log-dir",
                dir.path().to_str().unwrap(),
                "--vnodes",
                "64",
                "--drain-ms",
                "500",
            ],
            &dir.path().join("monitor.log"),
            "addr=",
        );
        MonitoredCluster {
            dir,
            dpm,
            routing,
            monitor,
            kn_port_base: base,
        }
    }

    /// A client that reports its latencies to the monitor.
    pub async fn client(&self) -> Client {
        let mut cfg = ClientConfig::new(&[&self.routing.addr]);
        cfg.deadline = Duration::from_secs(20);
        cfg.monitor = Some(self.monitor.addr.clone());
        cfg.report_every = Duration::from_millis(200);
        Client::connect_with(cfg).await.unwrap()
    }

    pub async fn admin(
        &self,
    ) -> dinomo_proto::monitor::monitor_service_client::MonitorServiceClient<
        tonic::transport::Channel,
    > {
        dinomo_proto::monitor::monitor_service_client::MonitorServiceClient::connect(format!(
            "http://{}",
            self.monitor.addr
        ))
        .await
        .unwrap()
    }

    pub async fn map(&self) -> ClusterMap {
        admin::published_map(&self.dpm.addr)
            .await
            .unwrap()
            .expect("a published map")
    }

    /// The pid of KN `kn` (a child of the monitor), found by its listen address.
    pub fn kn_pid(&self, kn: u32) -> i32 {
        let listen = format!("--listen 127.0.0.1:{}", u32::from(self.kn_port_base) + kn);
        let out = Command::new("pgrep")
            .args(["-f", &format!("kv-node --kn-id {kn} {listen}")])
            .output()
            .expect("pgrep");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .next()
            .unwrap_or_else(|| panic!("no process for KN {kn}"))
            .parse()
            .unwrap()
    }

    /// Prints the monitor's log (for a failing test).
    pub fn dump_monitor_log(&self) {
        let log = std::fs::read_to_string(self.dir.path().join("monitor.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(60).collect();
        for l in tail.into_iter().rev() {
            eprintln!("monitor| {l}");
        }
    }
}
