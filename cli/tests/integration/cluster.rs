//! A cluster harness: spawns the real nodes (this package's `dinomo` binary) on loopback ports
//! chosen by the OS, publishes maps, adds, removes and kills KV nodes.
//!
//! `DINOMO_TEST_FABRIC` (shm, the default, tcp or verbs) picks the fabric of the dpm-nodes the
//! harness starts (unless a test asks for one), so the same tests run over every fabric; verbs
//! needs a build with `--features rdma` and an RDMA device (scripts/vm-cluster.sh runs the
//! KN-kill tests that way inside the Soft-RoCE VM).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dinomo_client::{admin, Client, ClientConfig};
use dinomo_placement::{ClusterMap, KnInfo};

/// The environment that makes a node or `dinomo up` run without TLS (`--insecure`).
pub(crate) const INSECURE: (&str, &str) = ("DINOMO_INSECURE", "1");

pub struct Proc {
    child: Child,
    pub addr: String,
}

/// The dpm-nodes of these tests do not fault their pools in at start (a background pass of
/// about 0.6 s of CPU per 256 MiB pool on the CI machine, while the test's own deadlines run);
/// dpm-node's own tests cover prefaulting.
const NO_PREFAULT: (&str, &str) = ("DINOMO_DPM_PREFAULT", "false");

impl Proc {
    pub(crate) fn spawn(args: &[&str], log: &Path, field: &str) -> Proc {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dinomo"));
        // Plain text: every test but those in security.rs runs its nodes with --insecure, and
        // this process's SDK clients dial plain text (no identity installed).
        cmd.env(INSECURE.0, INSECURE.1);
        cmd.args(args)
            .arg("--print-ready")
            .env("DINOMO_LOG", "info")
            .env(NO_PREFAULT.0, NO_PREFAULT.1);
        let (child, line) = dinomo_node_common::spawn_until_ready(
            &format!("{args:?}"),
            cmd,
            log,
            Duration::from_secs(30),
        )
        .unwrap_or_else(|e| {
            panic!(
                "{e}; log: {}",
                std::fs::read_to_string(log).unwrap_or_default()
            )
        });
        let addr = dinomo_node_common::ready_field(&line, field)
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

/// The fabric the harness's dpm-nodes serve when a test does not ask for one:
/// `DINOMO_TEST_FABRIC`, else shm.
pub(crate) fn test_fabric() -> String {
    std::env::var("DINOMO_TEST_FABRIC")
        .ok()
        .filter(|f| !f.is_empty())
        .unwrap_or_else(|| "shm".to_string())
}

/// A dpm-node with a 256 MiB pool in `dir`, on OS-chosen ports, with `extra` flags (and
/// `--fabric` [`test_fabric`] unless `extra` names one).
pub(crate) fn spawn_dpm(dir: &Path, extra: &[&str]) -> Proc {
    let pool = dir.join("pool");
    let mut args = vec![
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
    ];
    args.extend_from_slice(extra);
    let fabric = test_fabric();
    if !extra.contains(&"--fabric") {
        args.extend(["--fabric", &fabric]);
    }
    Proc::spawn(&args, &dir.join("dpm.log"), "grpc=")
}

/// A dpm-node (pool in `dir`) and a routing node polling it every 20 ms, on OS-chosen ports.
pub(crate) fn dpm_and_routing(dir: &Path) -> (Proc, Proc) {
    let dpm = spawn_dpm(dir, &[]);
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

/// A base port such that `base + o` is free right now for every offset `o`, outside the
/// ephemeral range (see [`dinomo_node_common::address::free_port_base`]: a node the test
/// kills and starts again gets its port back).
pub(crate) fn free_port_base(offsets: &[i32]) -> u16 {
    dinomo_node_common::address::free_port_base(offsets)
        .unwrap_or_else(|| panic!("no free range of ports {offsets:?} outside the ephemeral range"))
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
        let base = free_port_base(&(1..=16).collect::<Vec<_>>());
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

/// A base port for `dinomo up --kns <= max_kns` such that every port it may use (see
/// `up --help`; KN ids up to `max_kns`, for KNs added later) is free right now (and outside
/// the ephemeral range: [`free_port_base`]).
pub(crate) fn up_port_base(max_kns: u16) -> u16 {
    // dpm, fabric, routing, monitor (BASE-100), and their metrics.
    // And the dpm-node backups of `--dpm-replicas` (BASE+20.., metrics BASE+2020..).
    let mut offsets = vec![
        0i32, 1, 200, -100, 2000, 2200, 1900, 20, 21, 22, 23, 2020, 2022,
    ];
    for i in 1..=i32::from(max_kns) {
        offsets.extend([100 + i, 2100 + i]);
    }
    free_port_base(&offsets)
}

/// Which node of an [`UpCluster`] a process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// The dpm-node (the primary, with `--dpm-replicas`).
    Dpm,
    /// A dpm-node backup (`--dpm-replicas`).
    DpmBackup,
    Routing,
    Monitor,
    Kn(u32),
}

/// One process of an [`UpCluster`], as `/proc` shows it.
#[derive(Debug, Clone)]
pub(crate) struct UpProc {
    pub pid: i32,
    pub role: Role,
    /// The `/proc/<pid>/stat` state: 'S'/'R' running, 'T' stopped, 'Z' dead, not yet reaped.
    pub state: char,
}

impl UpProc {
    /// Alive and not stopped.
    pub fn serving(&self) -> bool {
        !matches!(self.state, 'T' | 't' | 'Z' | 'X')
    }
}

/// A whole cluster run by `dinomo up` (which restarts a dpm-node, routing node or monitor that
/// dies; the monitor starts, recovers, adds and removes the KV nodes). `up` runs in a process
/// group of its own, which all its descendants share: dropping the harness wakes every
/// stopped process of the group, stops `up` with SIGTERM (it stops its children in order) and
/// SIGKILLs whatever of the group is left, so nothing outlives a failed test. `up` also gets
/// SIGTERM if the thread that started it dies (PR_SET_PDEATHSIG), so it is started from a
/// thread of its own that lives as long as the harness ([`Keeper`]).
pub(crate) struct UpCluster {
    child: Child,
    /// Dropped after `child` is stopped (fields drop after [`Drop::drop`]).
    _keeper: Keeper,
    pub dir: tempfile::TempDir,
    pub base: u16,
    /// `up`'s arguments but for the data directory and port base (for [`UpCluster::restart`]).
    args: Vec<String>,
    /// Started with TLS (see [`UpCluster::start_tls`]).
    pub tls: bool,
    stopped: bool,
}

impl UpCluster {
    /// `dinomo up` with `kns` KV nodes (1 shard, 1 MiB cache each), a 256 MiB pool and the
    /// monitor config `monitor_toml`, on free ports leaving room for KNs up to `max_kns`.
    /// Returns once `up` printed its endpoints (every node ready, the map published).
    /// The KNs write through `fabric` (`shm` or `tcp`); `monitor_toml` None: the embedded
    /// defaults.
    pub fn start_on(fabric: &str, kns: u32, max_kns: u16, monitor_toml: Option<&str>) -> UpCluster {
        Self::start_with(fabric, kns, max_kns, monitor_toml, false, &[])
    }

    /// [`UpCluster::start_on`] `fabric` with the dpm-node replicated (`--dpm-replicas`).
    pub fn start_replicated_on(
        fabric: &str,
        kns: u32,
        replicas: u32,
        monitor_toml: Option<&str>,
    ) -> UpCluster {
        let r = replicas.to_string();
        Self::start_with(
            fabric,
            kns,
            kns as u16,
            monitor_toml,
            false,
            &["--dpm-replicas", &r],
        )
    }

    /// [`UpCluster::start_on`] shm, as a new user runs it: with TLS (`up` makes the
    /// credentials under its data directory), from the data directory's parent as the current
    /// directory.
    pub fn start_tls(kns: u32) -> UpCluster {
        Self::start_with("shm", kns, kns as u16, None, true, &[])
    }

    fn start_with(
        fabric: &str,
        kns: u32,
        max_kns: u16,
        monitor_toml: Option<&str>,
        tls: bool,
        extra: &[&str],
    ) -> UpCluster {
        let dir = tempfile::tempdir().unwrap();
        let mut args: Vec<String> = [
            "--kns",
            &kns.to_string(),
            "--shards",
            "1",
            "--cache-size",
            "1MiB",
            "--pool-size",
            "256MiB",
            "--vnodes",
            "64",
            "--fabric",
            fabric,
        ]
        .iter()
        .chain(extra)
        .map(|s| s.to_string())
        .collect();
        if let Some(toml) = monitor_toml {
            let cfg = dir.path().join("monitor.toml");
            std::fs::write(&cfg, toml).unwrap();
            args.extend(["--monitor-config".to_string(), cfg.display().to_string()]);
        }
        // The ports were free when chosen, but another process may bind one before `up` does:
        // `up` then exits at once. Try other ports twice before giving up.
        let (mut dir, mut args) = (dir, args);
        for attempt in 1..=3 {
            let base = up_port_base(max_kns);
            let (mut up, e) = match Self::try_launch(dir, base, args, tls) {
                Ok(up) => return up,
                Err(failed) => failed,
            };
            if attempt == 3 || !up.exited() {
                up.dump_logs(40);
                panic!("dinomo up did not come up: {e}");
            }
            eprintln!("dinomo up on port base {base} exited before it was ready ({e}):");
            up.dump_logs(10);
            eprintln!("trying another port base");
            (dir, args) = up.into_parts();
        }
        unreachable!()
    }

    /// Stops the cluster; its data directory and `up` arguments.
    fn into_parts(mut self) -> (tempfile::TempDir, Vec<String>) {
        self.stop();
        let dir = std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap());
        (dir, std::mem::take(&mut self.args))
    }

    /// Whether `up` has exited.
    fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    /// Stops the whole cluster (as dropping it does) and runs `up` again on the same data
    /// directory and ports.
    pub fn restart(self) -> UpCluster {
        let (base, tls) = (self.base, self.tls);
        let (dir, args) = self.into_parts();
        match Self::try_launch(dir, base, args, tls) {
            Ok(up) => up,
            Err((up, e)) => {
                up.dump_logs(40);
                panic!("dinomo up did not come up again: {e}");
            }
        }
    }

    /// Runs `up`; on failure, the cluster (for its logs; dropping it stops what runs) and why.
    fn try_launch(
        dir: tempfile::TempDir,
        base: u16,
        args: Vec<String>,
        tls: bool,
    ) -> Result<UpCluster, (UpCluster, String)> {
        use std::os::unix::process::CommandExt;
        let data = dir.path().join(Self::data_dir_name(tls));
        let log = dir.path().join("up.log");
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_dinomo"));
        if tls {
            cmd.current_dir(dir.path()).env_remove(INSECURE.0);
        } else {
            cmd.env(INSECURE.0, INSECURE.1);
        }
        cmd.args(["up", "--data-dir", data.to_str().unwrap()])
            .args(["--port-base", &base.to_string()])
            .args(&args)
            .env("DINOMO_LOG", "info")
            .env(NO_PREFAULT.0, NO_PREFAULT.1)
            // A node's error, not a backtrace, should be the last line of its log.
            .env("RUST_BACKTRACE", "0")
            .stdout(Stdio::piped())
            .stderr(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(&log)
                    .unwrap(),
            )
            .process_group(0);
        // SAFETY: prctl is async-signal-safe and only touches the child being set up.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let (mut child, keeper) = Keeper::spawn(cmd);
        // `up` prints its endpoints, then this line, once every node is ready and the map is
        // published. On failure the harness is dropped, which stops the whole process group.
        let ready = dinomo_node_common::wait_for_line(
            &mut child,
            "dinomo up",
            &log,
            Duration::from_secs(90),
            |l| l.starts_with("Press Ctrl-C"),
        );
        let up = UpCluster {
            child,
            _keeper: keeper,
            dir,
            base,
            args,
            tls,
            stopped: false,
        };
        match ready {
            Ok(_) => Ok(up),
            Err(e) => Err((up, e.to_string())),
        }
    }

    /// `up`'s data directory: `.dinomo` under the test's directory with TLS (where the
    /// commands run from that directory find the credentials by default), else `data`.
    fn data_dir_name(tls: bool) -> &'static str {
        if tls {
            ".dinomo"
        } else {
            "data"
        }
    }

    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join(Self::data_dir_name(self.tls))
    }

    fn addr(&self, off: u16) -> String {
        format!("127.0.0.1:{}", self.base + off)
    }
    pub fn dpm_addr(&self) -> String {
        self.addr(0)
    }
    pub fn routing_addr(&self) -> String {
        self.addr(200)
    }
    pub fn monitor_addr(&self) -> String {
        format!("127.0.0.1:{}", self.base - 100)
    }
    /// The dpm-node's control and fabric ports.
    pub fn dpm_ports(&self) -> [u16; 2] {
        [self.base, self.base + 1]
    }
    /// KV node `id`'s gRPC port.
    pub fn kn_port(&self, id: u32) -> u16 {
        self.base + 100 + id as u16
    }

    /// Whether `up` itself still runs (it exits when a node keeps dying).
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The nodes of this cluster (`up`'s process group), found in `/proc`.
    pub fn procs(&self) -> Vec<UpProc> {
        let pgid = self.child.id() as i32;
        let mut out = Vec::new();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return out;
        };
        for e in dir.flatten() {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // pid (comm) state ppid pgrp ...: comm may hold spaces, so parse after the ')'.
            let Some(rest) = stat.rfind(')').map(|i| &stat[i + 1..]) else {
                continue;
            };
            let f: Vec<&str> = rest.split_whitespace().collect();
            if f.len() < 3 || f[2].parse::<i32>().ok() != Some(pgid) || pid == pgid {
                continue;
            }
            let state = f[0].chars().next().unwrap_or('?');
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let args: Vec<String> = cmdline
                .split(|&b| b == 0)
                .map(|a| String::from_utf8_lossy(a).into_owned())
                .collect();
            let role = match args.get(1).map(String::as_str) {
                Some("dpm-node") if args.windows(2).any(|w| w == ["--role", "backup"]) => {
                    Role::DpmBackup
                }
                Some("dpm-node") => Role::Dpm,
                Some("routing-node") => Role::Routing,
                Some("monitor") => Role::Monitor,
                Some("kv-node") => {
                    let id = args
                        .iter()
                        .position(|a| a == "--kn-id")
                        .and_then(|i| args.get(i + 1))
                        .and_then(|s| s.parse().ok());
                    match id {
                        Some(id) => Role::Kn(id),
                        None => continue,
                    }
                }
                // A zombie has an empty cmdline; its role no longer matters.
                _ => continue,
            };
            out.push(UpProc { pid, role, state });
        }
        out
    }

    /// The pid of the (serving or stopped, not dead) process in `role`.
    pub fn pid(&self, role: Role) -> Option<i32> {
        self.procs()
            .into_iter()
            .find(|p| p.role == role && !matches!(p.state, 'Z' | 'X'))
            .map(|p| p.pid)
    }

    /// SIGCONT to every process of the cluster.
    pub fn wake_all(&self) {
        // SAFETY: signalling this cluster's own process group.
        unsafe { libc::kill(-(self.child.id() as i32), libc::SIGCONT) };
    }

    /// The last `n` lines of `up`'s own log and of every node's log.
    pub fn dump_logs(&self, n: usize) {
        let mut logs = vec![self.dir.path().join("up.log")];
        if let Ok(d) = std::fs::read_dir(self.data_dir().join("logs")) {
            let mut v: Vec<PathBuf> = d.flatten().map(|e| e.path()).collect();
            v.sort();
            logs.extend(v);
        }
        for p in logs {
            let name = p
                .file_stem()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            let log = std::fs::read_to_string(&p).unwrap_or_default();
            let tail: Vec<&str> = log.lines().rev().take(n).collect();
            for l in tail.into_iter().rev() {
                eprintln!("{name}| {l}");
            }
        }
    }
}

impl UpCluster {
    /// Wakes every stopped process of the group, stops `up` with SIGTERM (it stops its
    /// children in order) and SIGKILLs whatever of the group is left.
    fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        let pgid = self.child.id() as i32;
        // Stopped processes would not act on SIGTERM: wake them first.
        self.wake_all();
        // SAFETY: signalling our own child.
        unsafe { libc::kill(pgid, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while std::time::Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        // Whatever is left of the group (up itself if it hung, orphans of a node it lost).
        // SAFETY: signalling this cluster's own process group.
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        let _ = self.child.wait();
    }
}

/// The thread a child with PR_SET_PDEATHSIG was started from, kept alive until this is dropped.
/// The signal fires when the *thread* that forked the child exits, not the process: started
/// from a blocking-pool thread (`spawn_blocking`), which exits after 10 s idle, `up` was
/// stopped 10 s into a test that left the pool idle that long.
struct Keeper {
    _stop: std::sync::mpsc::Sender<()>,
}

impl Keeper {
    fn spawn(mut cmd: Command) -> (Child, Keeper) {
        let (started_tx, started_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        std::thread::Builder::new()
            .name("up-keeper".into())
            .spawn(move || {
                let _ = started_tx.send(cmd.spawn());
                // Returns once the Keeper (its sender) is dropped.
                let _ = stop_rx.recv();
            })
            .unwrap();
        let child = started_rx.recv().unwrap().unwrap();
        (child, Keeper { _stop: stop_tx })
    }
}

impl Drop for UpCluster {
    fn drop(&mut self) {
        self.stop();
    }
}
