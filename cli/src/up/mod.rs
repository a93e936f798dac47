//! `dinomo up`: a whole local cluster as child processes of this binary: a dpm-node (shm, tcp
//! or verbs fabric; pool under the data directory, or `--pool`), a routing node and the
//! monitor, which starts the N
//! KV nodes itself (local orchestrator), publishes the cluster map (or resumes the published
//! one), and from then on adds, removes and recovers KV nodes and replicates hot keys as its
//! policy decides. `up` prints the endpoints and stops everything cleanly on Ctrl-C or SIGTERM.
//! It supervises its children: one that exits unexpectedly is started again (at most
//! `MAX_RESTARTS` times a minute), since everything it needs (pool, published map) persists.

use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use clap::Args;
use dinomo_client::admin;

mod replicas;

#[derive(Debug, Args, Clone)]
pub struct UpArgs {
    #[command(flatten)]
    pub security: dinomo_security::SecurityArgs,
    /// Where the pool and the logs live; reused on the next run.
    #[arg(long, default_value = ".dinomo")]
    pub data_dir: PathBuf,
    /// KV nodes to start. The monitor's policy may add or remove KNs later (not before its
    /// grace period, 90 s by default, has passed; see --monitor-config).
    #[arg(long, default_value_t = 2)]
    pub kns: u32,
    /// Ports: dpm-node = BASE, its fabric = BASE+1, KV node i = BASE+100+i, routing = BASE+200,
    /// monitor = BASE-100; metrics at BASE+2000 (dpm), BASE+2100+i (KNs), BASE+2200 (routing),
    /// BASE+1900 (monitor). With the default base these are each node's own defaults (dpm-node
    /// 7700, kv-node 7800, routing-node 7900, monitor 7600), which the CLI's commands dial.
    #[arg(long, default_value_t = 7700)]
    pub port_base: u16,
    /// The pool: a file (default: dinomo.pool in the data directory) or a device-DAX device
    /// such as /dev/dax0.0 (the pool then spans the device; see --format-device).
    #[arg(long)]
    pub pool: Option<PathBuf>,
    /// Format a device-DAX --pool that holds no Dinomo pool yet, erasing the device.
    #[arg(long)]
    pub format_device: bool,
    /// Size of a new pool (not on a device-DAX device: the pool is the whole device).
    #[arg(long, default_value = "1GiB")]
    pub pool_size: String,
    /// Log segment size of a new pool (a power of two >= 64KiB). Every KV node shard keeps a
    /// segment open and the index grows a segment at a time, so a small pool holds more data
    /// with smaller segments; a value (plus its key) must fit a quarter of a segment, so
    /// segments below 8MiB need a KV node config with a smaller max_value_bytes.
    #[arg(long, default_value = "8MiB")]
    pub segment_size: String,
    /// Shards per KV node.
    #[arg(long, default_value_t = 2)]
    pub shards: u32,
    /// Cache per KV node.
    #[arg(long, default_value = "256MiB")]
    pub cache_size: String,
    /// dac | shortcut-only | value-only | static-N.
    #[arg(long, default_value = "dac")]
    pub cache_policy: String,
    /// Runtime threads per KV node (default: this machine's cores divided among the KV
    /// nodes, at least 1). The KNs share one machine here, and a KN with as many threads as
    /// cores spends more CPU per request on cross-thread wakeups.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub kn_threads: Option<u16>,
    /// How KV nodes write their log segments into the pool: shm (mapped shared memory, the
    /// fastest on one machine), tcp (the dpm-node's software NIC on BASE+1, as KNs on other
    /// hosts without RDMA would) or verbs (one-sided RDMA, the side channel on BASE+1; needs a
    /// binary built with `--features rdma` and an RDMA device, e.g. Soft-RoCE's rxe0).
    /// Default: shm, or tcp with --dpm-replicas above 1.
    #[arg(long, value_parser = ["shm", "tcp", "verbs"])]
    pub fabric: Option<String>,
    /// Memory-node replicas: 1 (no replication), or a primary and N-1 backups, each with its
    /// own pool in the data directory (backup i serves at BASE+20+2(i-1)). A write is
    /// acknowledged once it is on every backup in sync; when the primary dies, a backup in sync
    /// takes its place (see docs/decisions/0007-dpm-replication.md). On shm and verbs the KV
    /// nodes forward each write to the dpm-node, which ships it to the backups (a round trip
    /// more per batch); on tcp its NIC ships what it applies.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=i64::from(replicas::MAX_REPLICAS)))]
    pub dpm_replicas: u32,
    /// RDMA device of the dpm-node and the KV nodes with --fabric verbs (default:
    /// $DINOMO_RDMA_DEVICE, else the first device).
    #[arg(long)]
    pub rdma_device: Option<String>,
    /// Virtual nodes per KV node on the hash ring.
    #[arg(long, default_value_t = 128)]
    pub vnodes: u32,
    /// The monitor's config file (policy: SLOs, bounds, epoch, grace period; see
    /// config/monitor.toml). Default: the embedded defaults.
    #[arg(long)]
    pub monitor_config: Option<PathBuf>,
}

/// A backup's arguments: the security ones, and the fabric it serves its KNs once promoted in
/// place (`dinomo admin promote-backup`): verbs, with its RDMA device, for a verbs cluster;
/// tcp for shm and tcp (see the dpm-node's `--role`). Always given, so that a
/// `DINOMO_DPM_FABRIC` in `up`'s environment does not decide it.
fn backup_args(security: Vec<String>, fabric: &str, rdma_device: &Option<String>) -> Vec<String> {
    let mut args = security;
    if fabric == "verbs" {
        args.extend(["--fabric".into(), "verbs".into()]);
        if let Some(d) = rdma_device {
            args.extend(["--rdma-device".into(), d.clone()]);
        }
    } else {
        args.extend(["--fabric".into(), "tcp".into()]);
    }
    args
}

/// A child node and the line it printed when ready.
pub(crate) struct Node {
    name: String,
    child: Child,
    /// How it was started, to start it again.
    args: Vec<String>,
    log: PathBuf,
    /// When `up` restarted it lately (for the restart budget).
    restarts: Vec<Instant>,
    /// When the next restart attempt is due (set once the node is seen dead).
    due: Option<Instant>,
}

/// A node that exits unexpectedly is restarted, at most this many times in [`RESTART_WINDOW`];
/// one that keeps dying (a bad config, a corrupt pool) stops the cluster instead. The first
/// restart in a window is immediate; each further one waits twice as long as the one before
/// (from 500 ms, at most [`MAX_RESTART_DELAY`]), so a cause that clears in seconds (a port
/// still held by a node that is stopping) does not spend the budget in one second.
const MAX_RESTARTS: usize = 8;
const RESTART_WINDOW: Duration = Duration::from_secs(60);
const MAX_RESTART_DELAY: Duration = Duration::from_secs(8);

/// The wait before a restart attempt, after `recent` attempts within the window.
fn restart_delay(recent: usize) -> Duration {
    match recent {
        0 => Duration::ZERO,
        n => (Duration::from_millis(500) * 2u32.pow((n as u32 - 1).min(8))).min(MAX_RESTART_DELAY),
    }
}

impl Node {
    /// How long to wait before the next restart attempt.
    fn restart_delay(&self) -> Duration {
        restart_delay(self.restarts.len())
    }

    /// Starts this node again after it exited; false once its restart budget is spent.
    fn restart(&mut self) -> anyhow::Result<bool> {
        let now = Instant::now();
        self.restarts
            .retain(|t| now.duration_since(*t) < RESTART_WINDOW);
        if self.restarts.len() >= MAX_RESTARTS {
            return Ok(false);
        }
        // An attempt counts even if it fails (the node died again before it was ready): the
        // next supervision round tries again, until the budget is spent.
        self.restarts.push(now);
        let (fresh, _) = spawn(&self.name, &self.args, &self.log)?;
        self.child = fresh.child;
        Ok(true)
    }
}

/// How long a node may take to print its READY line.
const READY_TIMEOUT: Duration = Duration::from_secs(60);

pub(crate) fn spawn(name: &str, args: &[String], log: &Path) -> anyhow::Result<(Node, String)> {
    let exe = std::env::current_exe().context("locating the dinomo binary")?;
    let mut cmd = Command::new(exe);
    cmd.args(args).arg("--print-ready");
    let (child, line) = dinomo_node_common::spawn_until_ready(name, cmd, log, READY_TIMEOUT)?;
    Ok((
        Node {
            name: name.to_string(),
            child,
            args: args.to_vec(),
            log: log.to_path_buf(),
            restarts: Vec::new(),
            due: None,
        },
        line,
    ))
}

pub(crate) fn stop(nodes: &mut Vec<Node>) {
    // Reverse start order: the monitor (it stops the KNs, which seal their logs), routing,
    // then the DPM.
    while let Some(mut n) = nodes.pop() {
        // SAFETY: signalling our own child.
        unsafe { libc::kill(n.child.id() as i32, libc::SIGTERM) };
        let start = Instant::now();
        loop {
            match n.child.try_wait() {
                Ok(Some(_)) => break,
                Ok(None) if start.elapsed() < Duration::from_secs(15) => {
                    std::thread::sleep(Duration::from_millis(20))
                }
                _ => {
                    eprintln!("{} did not stop in 15 s; killing it", n.name);
                    let _ = n.child.kill();
                    let _ = n.child.wait();
                    break;
                }
            }
        }
    }
}

/// Restarts every node that exited; returns the name of one that could not be restarted.
fn supervise(nodes: &mut [Node]) -> Option<String> {
    for n in nodes.iter_mut() {
        let Ok(Some(status)) = n.child.try_wait() else {
            continue;
        };
        let now = Instant::now();
        match n.due {
            None => {
                let delay = n.restart_delay();
                n.due = Some(now + delay);
                eprintln!(
                    "{} exited unexpectedly ({status}); restarting it in {} ms (see {})",
                    n.name,
                    delay.as_millis(),
                    n.log.display()
                );
                if !delay.is_zero() {
                    continue;
                }
            }
            Some(t) if now < t => continue,
            Some(_) => {}
        }
        n.due = None;
        match n.restart() {
            Ok(true) => eprintln!("{} is back", n.name),
            Ok(false) => {
                eprintln!(
                    "{} exited {MAX_RESTARTS} times within {} s; giving up",
                    n.name,
                    RESTART_WINDOW.as_secs()
                );
                return Some(n.name.clone());
            }
            Err(e) => eprintln!("{} could not be restarted ({e:#}); trying again", n.name),
        }
    }
    None
}

pub async fn run(a: UpArgs) -> anyhow::Result<()> {
    if a.kns == 0 {
        bail!("--kns must be at least 1");
    }
    let fabric = a
        .fabric
        .clone()
        .unwrap_or_else(|| if a.dpm_replicas > 1 { "tcp" } else { "shm" }.to_string());
    if fabric == "verbs" && !cfg!(feature = "rdma") {
        bail!(
            "--fabric verbs: this dinomo binary was built without the `rdma` cargo feature; \
             rebuild it with `cargo build --release -p dinomo-cli --features rdma`"
        );
    }
    if a.rdma_device.is_some() && fabric != "verbs" {
        bail!("--rdma-device applies only to --fabric verbs");
    }
    // The monitor listens on BASE-100, and port 0 would mean "any port".
    if a.port_base <= 100 {
        bail!("--port-base must be above 100 (the monitor listens on port-base - 100)");
    }
    // `up` starts a failed node again on its port; a port of the ephemeral range may meanwhile
    // have become the local port of a client connection, whose TIME_WAIT holds it for a minute.
    let ephemeral = dinomo_node_common::address::ephemeral_ports();
    // BASE-100 (the monitor) up to BASE+2200 (the routing node's metrics), or the last KN's
    // metrics port (BASE+2100+id) when there are more than 100 KNs.
    let (first, last) = (
        a.port_base - 100,
        a.port_base.saturating_add(2200).max(
            a.port_base
                .saturating_add(2100)
                .saturating_add(u16::try_from(a.kns).unwrap_or(u16::MAX)),
        ),
    );
    if first <= *ephemeral.end() && last >= *ephemeral.start() {
        let below = ephemeral.start().saturating_sub(2300);
        let above = u32::from(*ephemeral.end()) + 101;
        let avoid = match (below > 1124, above + 2200 <= 65_535) {
            (true, _) => format!("a base of {below} or below avoids it"),
            (false, true) => format!("a base of {above} or above avoids it"),
            (false, false) => "no base avoids it on this host".to_string(),
        };
        tracing::warn!(
            "--port-base {}: the cluster's ports ({first}-{last}) overlap the ports this host \
             gives outgoing connections ({}-{}, net.ipv4.ip_local_port_range): a node started \
             again after a failure may find its port taken for up to a minute; {avoid}",
            a.port_base,
            ephemeral.start(),
            ephemeral.end(),
        );
    }
    let logs = a.data_dir.join("logs");
    std::fs::create_dir_all(&logs).with_context(|| format!("creating {}", logs.display()))?;
    let credentials_dir = a.data_dir.join("credentials");
    let secured = crate::credentials::LocalCluster::prepare(&a.security, &credentials_dir)?;
    // `up` itself reads the published map as the admin.
    secured.admin.install_for_process();
    let b = a.port_base;
    let port = |off: u16| -> anyhow::Result<String> {
        Ok(format!(
            "127.0.0.1:{}",
            b.checked_add(off).context("--port-base too high")?
        ))
    };
    let dpm = port(0)?;
    let pool = a
        .pool
        .clone()
        .unwrap_or_else(|| a.data_dir.join("dinomo.pool"));
    let mut dpm_args: Vec<String> = secured.node_args("dpm")?;
    if a.format_device {
        dpm_args.push("--format-device".into());
    }
    if let Some(d) = &a.rdma_device {
        dpm_args.extend(["--rdma-device".into(), d.clone()]);
    }
    let mut nodes = Vec::new();
    let mut replica_set: Option<replicas::ReplicaSet> = None;
    let result = async {
        let primary_args = [
                "dpm-node".into(),
                "--pool".into(),
                pool.display().to_string(),
                "--pool-size".into(),
                a.pool_size.clone(),
                "--segment-size".into(),
                a.segment_size.clone(),
                "--listen".into(),
                dpm.clone(),
                "--fabric".into(),
                fabric.clone(),
                "--fabric-listen".into(),
                port(1)?,
                "--metrics-listen".into(),
                port(2000)?,
            ]
            .into_iter()
            .chain(dpm_args)
            .collect::<Vec<_>>();
        if a.dpm_replicas > 1 {
            replica_set = Some(
                replicas::ReplicaSet::start(replicas::SetSpec {
                    replicas: a.dpm_replicas,
                    port_base: b,
                    data_dir: &a.data_dir,
                    logs: &logs,
                    primary_args,
                    pool: pool.clone(),
                    node_args: backup_args(secured.node_args("dpm")?, &fabric, &a.rdma_device),
                })
                .await?,
            );
        } else {
            let (n, _) = spawn("dpm-node", &primary_args, &logs.join("dpm-node.log"))?;
            nodes.push(n);
        }
        let routing = port(200)?;
        let (n, _) = spawn(
            "routing-node",
            &[
                "routing-node".into(),
                "--listen".into(),
                routing.clone(),
                "--dpm".into(),
                dpm.clone(),
                "--metrics-listen".into(),
                port(2200)?,
            ]
            .into_iter()
            .chain(secured.node_args("routing")?)
            .collect::<Vec<_>>(),
            &logs.join("routing-node.log"),
        )?;
        nodes.push(n);
        let monitor = format!("127.0.0.1:{}", b - 100);
        let kn_port_base = b.checked_add(100).context("--port-base too high")?;
        let kn_metrics_base = b.checked_add(2100).context("--port-base too high")?;
        let mut margs: Vec<String> = vec![
            "monitor".into(),
            "--listen".into(),
            monitor.clone(),
            "--dpm".into(),
            dpm.clone(),
            "--metrics-listen".into(),
            port(1900)?,
            "--routing".into(),
            routing.clone(),
            "--kns".into(),
            a.kns.to_string(),
            "--kn-port-base".into(),
            kn_port_base.to_string(),
            "--kn-metrics-port-base".into(),
            kn_metrics_base.to_string(),
            "--log-dir".into(),
            logs.display().to_string(),
            "--vnodes".into(),
            a.vnodes.to_string(),
        ];
        // The monitor's credentials, and the KNs' it passes on to the KNs it starts.
        margs.extend(secured.monitor_args()?);
        let rdma = a.rdma_device.iter().map(|d| ("--rdma-device", d.clone()));
        let kn_threads = a.kn_threads.unwrap_or_else(|| {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            (cores / a.kns.max(1) as usize).clamp(1, 1024) as u16
        });
        for (flag, v) in [
            ("--shards", a.shards.to_string()),
            ("--cache-size", a.cache_size.clone()),
            ("--cache-policy", a.cache_policy.clone()),
            ("--worker-threads", kn_threads.to_string()),
        ]
        .into_iter()
        .chain(rdma)
        {
            margs.push(format!("--kn-arg={flag}"));
            margs.push(format!("--kn-arg={v}"));
        }
        if let Some(c) = &a.monitor_config {
            margs.push("--config".into());
            margs.push(c.display().to_string());
        }
        let (n, _) = spawn("monitor", &margs, &logs.join("monitor.log"))?;
        nodes.push(n);
        let map = admin::published_map(&dpm)
            .await?
            .context("the monitor started but no cluster map is published")?;
        println!(
            "Dinomo is up ({} KV nodes, {} fabric, pool {}, data in {}).",
            a.kns,
            fabric,
            pool.display(),
            a.data_dir.display()
        );
        println!("  routing node   {routing}    <- clients connect here (dinomo kv --routing {routing} ...)");
        println!("  dpm-node       {dpm}    (metrics http://{}/metrics)", port(2000)?);
        if let Some(set) = &replica_set {
            println!(
                "  dpm backups    {}    (in sync; `dinomo status` shows the replica set, `dinomo admin fail-dpm` kills the primary)",
                set.backup_addrs().join(" ")
            );
        }
        println!("  monitor        {monitor}    (dinomo admin --monitor {monitor} status|add-kn|remove-kn N|fail-kn N)");
        for k in &map.kns {
            println!("  kv-node {}      {}    (metrics http://127.0.0.1:{}/metrics)", k.id, k.endpoint, u32::from(kn_metrics_base) + k.id);
        }
        println!("  logs           {}", logs.display());
        match secured.admin.identity() {
            Some(id) => println!(
                "  credentials    {}    (mutual TLS; commands find them with --credentials or DINOMO_CREDENTIALS, default .dinomo/credentials)",
                id.dir.display()
            ),
            None => println!("  credentials    none: --insecure, no TLS (commands need --insecure too)"),
        }
        println!("Press Ctrl-C to stop.");
        anyhow::Ok(())
    }
    .await;
    if let Err(e) = result {
        stop(&mut nodes);
        if let Some(set) = replica_set {
            set.stop();
        }
        return Err(e);
    }
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    // Supervision: a node that exits unexpectedly is started again with the same arguments.
    // The pool and the published map are persistent, so a new dpm-node serves the same data;
    // KV nodes re-register with it, and a new monitor resumes the published map.
    let exited = loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => break None,
            _ = term.recv() => break None,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {
                if let Some(gave_up) = supervise(&mut nodes) {
                    break Some(gave_up);
                }
                if let Some(set) = &mut replica_set {
                    if let Err(e) = set.supervise().await {
                        eprintln!("{e:#}");
                        break Some("the dpm-node replica set".to_string());
                    }
                }
            }
        }
    };
    println!("stopping...");
    stop(&mut nodes);
    if let Some(set) = replica_set {
        set.stop();
    }
    match exited {
        Some(name) => bail!(
            "{name} kept exiting and could not be restarted; the cluster was stopped (see {})",
            logs.display()
        ),
        None => {
            println!("stopped.");
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_back_off_and_the_budget_spans_half_a_minute() {
        let delays: Vec<u64> = (0..MAX_RESTARTS)
            .map(|n| restart_delay(n).as_millis() as u64)
            .collect();
        assert_eq!(delays, [0, 500, 1000, 2000, 4000, 8000, 8000, 8000]);
        let total: u64 = delays.iter().sum();
        assert!(total < RESTART_WINDOW.as_millis() as u64, "{total}");
    }

    /// Backups of a verbs cluster serve verbs once promoted in place, on the named device;
    /// on shm and tcp they are told tcp (what a promoted backup serves there).
    #[test]
    fn backups_of_a_verbs_cluster_are_told_verbs_and_its_device() {
        let sec = vec!["--insecure".to_string()];
        let dev = Some("rxe0".to_string());
        for fabric in ["tcp", "shm"] {
            assert_eq!(
                backup_args(sec.clone(), fabric, &None),
                ["--insecure", "--fabric", "tcp"]
            );
        }
        assert_eq!(
            backup_args(sec.clone(), "verbs", &dev),
            ["--insecure", "--fabric", "verbs", "--rdma-device", "rxe0"]
        );
        assert_eq!(
            backup_args(sec, "verbs", &None),
            ["--insecure", "--fabric", "verbs"]
        );
    }
}
