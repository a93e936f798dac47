//! The kv-node's command line (flags, config file, environment) -> [`crate::server::run`].
//! Used by the `kv-node` binary and by `dinomo kv-node`.

use std::path::PathBuf;

use crate::cache::Policy;
use crate::config::KnConfigFile;
use anyhow::Context;
use clap::Parser;
use dinomo_node_common::config::{load_toml, ByteSize};

/// A Dinomo KV node: owns key ranges, caches values and shortcuts (DAC), and writes batched
/// logs to the dpm-node with one-sided operations.
#[derive(Debug, Clone, Parser)]
#[command(version, about, long_about = None)]
pub struct Args {
    /// Configuration file (TOML; see config/kv-node.toml). Without it, defaults apply.
    #[arg(long, short, env = "DINOMO_KN_CONFIG")]
    pub config: Option<PathBuf>,
    /// KN id to register as (overrides kn_id).
    #[arg(long, env = "DINOMO_KN_ID", conflicts_with = "id_from_ordinal")]
    pub kn_id: Option<u32>,
    /// Take the KN id from this pod's StatefulSet ordinal: id = ordinal + 1, as the monitor's
    /// kubernetes orchestrator numbers KNs. The ordinal is read from DINOMO_KN_POD_INDEX (set
    /// it from the pod's apps.kubernetes.io/pod-index label with the downward API) or else
    /// from the host name, which ends in -<ordinal> in a StatefulSet pod.
    #[arg(long, env = "DINOMO_KN_ID_FROM_ORDINAL")]
    pub id_from_ordinal: bool,
    /// KvService address (overrides listen).
    #[arg(long, env = "DINOMO_KN_LISTEN")]
    pub listen: Option<String>,
    /// Address clients reach this KN at, HOST:PORT or HOST (overrides advertise). Default:
    /// the listen address, or the address this host's name resolves to when listening on a wildcard such as 0.0.0.0.
    #[arg(long, env = "DINOMO_KN_ADVERTISE")]
    pub advertise: Option<String>,
    /// dpm-node gRPC address (overrides dpm).
    #[arg(long, env = "DINOMO_KN_DPM")]
    pub dpm: Option<String>,
    /// Worker shards (overrides shards).
    #[arg(long, env = "DINOMO_KN_SHARDS")]
    pub shards: Option<u32>,
    /// Cache size, e.g. 64MiB (overrides cache_size).
    #[arg(long, env = "DINOMO_KN_CACHE_SIZE")]
    pub cache_size: Option<ByteSize>,
    /// dac | shortcut-only | value-only | static-N (overrides cache_policy).
    #[arg(long, env = "DINOMO_KN_CACHE_POLICY")]
    pub cache_policy: Option<Policy>,
    /// Metrics address, "" to disable (overrides metrics_listen).
    #[arg(long, env = "DINOMO_KN_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// Local RDMA device for the verbs fabric, e.g. rxe0 (overrides rdma_device; default
    /// $DINOMO_RDMA_DEVICE, else the first device). Used only when the dpm-node offers verbs.
    #[arg(long, env = "DINOMO_KN_RDMA_DEVICE")]
    pub rdma_device: Option<String>,
    /// Threads of the node's async runtime (default: one per core). Several KNs sharing a
    /// machine (`dinomo up`) do better with a share of the cores each: every thread more is
    /// more cross-thread wakeups per request. A process setting, so not in the config file
    /// (the runtime exists before the file is read).
    #[arg(long, env = "DINOMO_KN_WORKER_THREADS", value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub worker_threads: Option<u16>,
    /// Print "READY addr=<addr> kn=<id>" on stdout once serving (for harnesses).
    #[arg(long)]
    pub print_ready: bool,
    #[command(flatten)]
    pub security: dinomo_security::SecurityArgs,
    #[command(flatten)]
    pub health: dinomo_node_common::health::HealthArgs,
}

impl Args {
    /// The runtime this node runs on (see `--worker-threads`).
    pub fn runtime(&self) -> std::io::Result<tokio::runtime::Runtime> {
        dinomo_node_common::runtime(self.worker_threads)
    }
}

/// The KN id of this StatefulSet pod: its ordinal + 1 (see `--id-from-ordinal`).
fn id_from_ordinal() -> anyhow::Result<u32> {
    let ordinal = match std::env::var("DINOMO_KN_POD_INDEX") {
        Ok(v) if !v.trim().is_empty() => v.trim().parse::<u32>().map_err(|_| {
            anyhow::anyhow!("DINOMO_KN_POD_INDEX = {v:?} is not a pod ordinal (0, 1, ...)")
        })?,
        _ => {
            let host = dinomo_node_common::address::host_name().context(
                "--id-from-ordinal: DINOMO_KN_POD_INDEX is not set and this host has no name",
            )?;
            dinomo_node_common::address::ordinal_from_name(&host)
                .map_err(|e| anyhow::anyhow!("--id-from-ordinal: {e}; set DINOMO_KN_POD_INDEX"))?
        }
    };
    let id = ordinal
        .checked_add(1)
        .context("--id-from-ordinal: ordinal too large")?;
    tracing::info!(ordinal, kn_id = id, "KN id from the pod ordinal");
    Ok(id)
}

/// Initialises logging to stderr (see [`dinomo_node_common::init_tracing`]).
pub fn init_tracing() {
    dinomo_node_common::init_tracing();
}

/// Runs the node with these arguments until SIGINT or SIGTERM.
pub async fn run(args: Args) -> anyhow::Result<()> {
    // Flags (and their DINOMO_KN_* variables) over the file over the defaults.
    let mut file: KnConfigFile = load_toml(args.config.as_deref())?;
    if args.kn_id.is_some() {
        file.kn_id = args.kn_id;
    }
    if args.id_from_ordinal {
        file.kn_id = Some(id_from_ordinal()?);
    }
    if let Some(v) = args.listen {
        file.listen = v;
    }
    if let Some(v) = args.advertise {
        file.advertise = v;
    }
    if let Some(v) = args.dpm {
        file.dpm = v;
    }
    if let Some(v) = args.shards {
        file.shards = v;
    }
    if let Some(v) = args.cache_size {
        file.cache_size = v;
    }
    if let Some(v) = args.cache_policy {
        file.cache_policy = v;
    }
    if let Some(v) = args.metrics_listen {
        file.metrics_listen = v;
    }
    if let Some(v) = args.rdma_device {
        file.rdma_device = v;
    }
    let mut config = file.validate().context("invalid configuration")?;
    config.security = args.security.node("kn", dinomo_security::Role::Node)?;
    config.security.install_for_process();
    args.health.install().context("--health-addr")?;
    dinomo_node_common::install_metrics(config.metrics_listen)?;
    let print_ready = args.print_ready;
    let shutdown = dinomo_node_common::shutdown_signal();
    crate::server::run(config, shutdown, |r| {
        if print_ready {
            println!("READY addr={} kn={} epoch={}", r.addr, r.kn_id, r.epoch);
        }
    })
    .await?;
    Ok(())
}
