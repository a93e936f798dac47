//! The dpm-node's command line (flags, config file, environment) -> [`crate::server::run`].
//! Used by the `dpm-node` binary and by `dinomo dpm-node`.

use std::path::PathBuf;

use crate::config::{DpmConfigFile, FabricKind, ReplicaRole};
use anyhow::Context;
use clap::Parser;
use dinomo_node_common::config::{load_toml, ByteSize};

/// The Dinomo DPM node: owns the persistent-memory pool, merges KV-node logs into the index,
/// collects garbage and keeps cluster metadata.
#[derive(Debug, Clone, Parser)]
#[command(version, about, long_about = None)]
pub struct Args {
    /// Configuration file (TOML; see config/dpm-node.toml). Without it, defaults apply.
    #[arg(long, short, env = "DINOMO_DPM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Pool file, or device-DAX device such as /dev/dax0.0 (overrides pool_path).
    #[arg(long, env = "DINOMO_DPM_POOL")]
    pub pool: Option<PathBuf>,
    /// Format a device-DAX --pool that holds no Dinomo pool, erasing it (sets format_device).
    #[arg(long, env = "DINOMO_DPM_FORMAT_DEVICE")]
    pub format_device: bool,
    /// Size of a new pool, e.g. 1GiB (overrides pool_size).
    #[arg(long, env = "DINOMO_DPM_POOL_SIZE")]
    pub pool_size: Option<ByteSize>,
    /// Log segment size of a new pool, a power of two >= 64KiB, e.g. 8MiB (overrides
    /// segment_size). Small pools want small segments: every KV node shard keeps one segment
    /// open, and the index grows a segment at a time.
    #[arg(long, env = "DINOMO_DPM_SEGMENT_SIZE")]
    pub segment_size: Option<ByteSize>,
    /// gRPC address (overrides listen).
    #[arg(long, env = "DINOMO_DPM_LISTEN")]
    pub listen: Option<String>,
    /// Fabric NIC address (overrides fabric_listen).
    #[arg(long, env = "DINOMO_DPM_FABRIC_LISTEN")]
    pub fabric_listen: Option<String>,
    /// Address KNs reach the fabric NIC (tcp, or verbs's side channel) at, HOST:PORT or HOST
    /// (overrides fabric_advertise). Default: the NIC's listen address, or the address this
    /// host's name resolves to when it listens on a wildcard such as 0.0.0.0.
    #[arg(long, env = "DINOMO_DPM_FABRIC_ADVERTISE")]
    pub fabric_advertise: Option<String>,
    /// shm, tcp or verbs (overrides fabric; verbs needs a build with the `rdma` feature).
    #[arg(long, env = "DINOMO_DPM_FABRIC")]
    pub fabric: Option<FabricKind>,
    /// RDMA device of the verbs NIC, e.g. rxe0 (overrides rdma_device; default
    /// $DINOMO_RDMA_DEVICE, else the first device).
    #[arg(long, env = "DINOMO_DPM_RDMA_DEVICE")]
    pub rdma_device: Option<String>,
    /// Metrics address, "" to disable (overrides metrics_listen).
    #[arg(long, env = "DINOMO_DPM_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// Merge worker threads (overrides merge_workers).
    #[arg(long, env = "DINOMO_DPM_MERGE_WORKERS")]
    pub merge_workers: Option<usize>,
    /// Fault the pool into memory in the background at start: true or false (overrides
    /// prefault; default true).
    #[arg(long, env = "DINOMO_DPM_PREFAULT")]
    pub prefault: Option<bool>,
    /// primary (the default) or backup: a backup holds a mirror of a primary's pool, written
    /// only by the primary that attaches it (over the tcp fabric NIC on --fabric-listen), and
    /// is promoted by starting it again as a primary on the same pool, or in place by the
    /// monitor. A backup's --fabric says what it serves its KNs once promoted: verbs (it
    /// needs an RDMA device then), or tcp for any other setting (overrides role).
    #[arg(long, env = "DINOMO_DPM_ROLE")]
    pub role: Option<ReplicaRole>,
    /// A backup's gRPC address, repeatable or comma-separated: this primary replicates its
    /// pool to each one, and acknowledges a write only once every backup in sync holds it
    /// (overrides backups).
    #[arg(long = "backup", env = "DINOMO_DPM_BACKUPS", value_delimiter = ',')]
    pub backups: Vec<String>,
    /// Last resort, loses data: open a half-copied backup pool as a primary.
    ///
    /// Opens the pool even if its copy marker (<pool>.copy) says "incomplete": the pool is a
    /// backup's copy of a primary's pool that was never finished, a mix of copied and zeroed
    /// chunks. THIS LOSES DATA: what was not copied is gone, and recovery may turn what is
    /// left into a state the cluster never was in. Only for a last-resort recovery when no
    /// complete copy exists (no primary pool, no backup that was in sync). A marker this
    /// dpm-node cannot read counts as incomplete. The marker is removed once the pool is open.
    /// Not settable in the config file.
    #[arg(long)]
    pub accept_incomplete_copy: bool,
    /// Print "READY grpc=<addr> fabric=<endpoint>" on stdout once serving (for harnesses;
    /// the endpoint is the tcp NIC's address, shm:<pool> or verbs:<side channel address>).
    #[arg(long)]
    pub print_ready: bool,
    #[command(flatten)]
    pub security: dinomo_security::SecurityArgs,
    #[command(flatten)]
    pub health: dinomo_node_common::health::HealthArgs,
}

/// Initialises logging to stderr (see [`dinomo_node_common::init_tracing`]).
pub fn init_tracing() {
    dinomo_node_common::init_tracing();
}

/// Runs the node with these arguments until SIGINT or SIGTERM.
pub async fn run(args: Args) -> anyhow::Result<()> {
    // Flags (and their DINOMO_DPM_* variables) over the file over the defaults.
    let mut file: DpmConfigFile = load_toml(args.config.as_deref())?;
    if let Some(v) = args.pool {
        file.pool_path = v;
    }
    if let Some(v) = args.pool_size {
        file.pool_size = v;
    }
    if let Some(v) = args.segment_size {
        file.segment_size = v;
    }
    if let Some(v) = args.listen {
        file.listen = v;
    }
    if let Some(v) = args.fabric_listen {
        file.fabric_listen = v;
    }
    if let Some(v) = args.fabric {
        file.fabric = v;
    }
    if let Some(v) = args.fabric_advertise {
        file.fabric_advertise = v;
    }
    if let Some(v) = args.rdma_device {
        file.rdma_device = v;
    }
    if args.format_device {
        file.format_device = true;
    }
    if let Some(v) = args.metrics_listen {
        file.metrics_listen = v;
    }
    if let Some(v) = args.merge_workers {
        file.merge_workers = v;
    }
    if let Some(v) = args.prefault {
        file.prefault = v;
    }
    if let Some(v) = args.role {
        file.role = v;
    }
    if !args.backups.is_empty() {
        file.backups = args.backups;
    }
    let mut config = file.validate().context("invalid configuration")?;
    if args.accept_incomplete_copy && config.role == ReplicaRole::Backup {
        anyhow::bail!(
            "--accept-incomplete-copy is for opening a pool as a primary; a backup's pool is \
             replaced by every attach anyway"
        );
    }
    config.accept_incomplete_copy = args.accept_incomplete_copy;
    config.security = args.security.node("dpm", dinomo_security::Role::Node)?;
    config.security.install_for_process();
    args.health.install().context("--health-addr")?;
    dinomo_node_common::install_metrics(config.metrics_listen)?;
    let print_ready = args.print_ready;
    let shutdown = dinomo_node_common::shutdown_signal();
    crate::server::run(config, shutdown, |r| {
        if print_ready {
            println!("READY grpc={} fabric={}", r.grpc, r.fabric);
        }
    })
    .await?;
    Ok(())
}
