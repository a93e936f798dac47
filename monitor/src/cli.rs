//! The monitor's command line. Used by the `monitor` binary and by `dinomo monitor`.
//!
//! Settings come from the config file (`--config`, documented in config/monitor.toml); the
//! flags below override the file. With the local orchestrator the monitor starts `--kns` KV
//! nodes itself (see [`crate::server::bootstrap_local`]); with kubernetes and external it
//! waits for the KNs of the first map to register ([`crate::server::bootstrap_registered`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;

use crate::config::{MonitorConfig, OrchestratorKind};
use crate::orchestrator::external::ExternalOrchestrator;
use crate::orchestrator::local::{LocalConfig, LocalOrchestrator};
use crate::orchestrator::Orchestrator;
use crate::server::FirstMap;
use crate::{Monitor, MonitorOptions};

/// The Dinomo monitor (M-node): SLO policy engine, reconfiguration, failover, selective
/// replication of hot keys.
#[derive(Debug, Clone, Parser)]
#[command(version, about, long_about = None)]
pub struct Args {
    /// Config file (TOML; every field is documented in config/monitor.toml).
    #[arg(long, short, env = "DINOMO_MONITOR_CONFIG")]
    pub config: Option<PathBuf>,
    /// MonitorService address (overrides server.listen).
    #[arg(long, env = "DINOMO_MONITOR_LISTEN")]
    pub listen: Option<String>,
    /// Address clients reach MonitorService at, HOST:PORT (overrides server.advertise;
    /// default: the listen address unless it is a wildcard such as 0.0.0.0). Published at the
    /// dpm-node while this monitor leads; routing nodes hand it to clients for their latency
    /// reports.
    #[arg(long, env = "DINOMO_MONITOR_ADVERTISE")]
    pub advertise: Option<String>,
    /// Who runs the KV nodes: local (child processes), kubernetes (a StatefulSet's pods) or
    /// external (started by someone else; adopted once they register with the dpm-node).
    /// Overrides orchestrator.kind.
    #[arg(long, value_enum, env = "DINOMO_MONITOR_ORCHESTRATOR")]
    pub orchestrator: Option<OrchestratorKind>,
    /// dpm-node gRPC address (overrides server.dpm).
    #[arg(long, env = "DINOMO_MONITOR_DPM")]
    pub dpm: Option<String>,
    /// Prometheus /metrics address; "" disables it (overrides server.metrics_listen).
    #[arg(long, env = "DINOMO_MONITOR_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// A routing node, to time how fast a recovered map is served (repeatable).
    #[arg(long)]
    pub routing: Vec<String>,
    /// Policy decision epoch in milliseconds (overrides policy.epoch_ms).
    #[arg(long)]
    pub epoch_ms: Option<u64>,
    /// Grace period in milliseconds (overrides policy.grace_period_ms).
    #[arg(long)]
    pub grace_period_ms: Option<u64>,
    /// How long a removed KN keeps serving in-flight requests before it is stopped.
    #[arg(long, default_value_t = 500)]
    pub drain_ms: u64,
    /// local: KV nodes to run (started at boot; the policy may add or remove some later).
    /// external: how many registered KNs the first cluster map waits for.
    #[arg(long, default_value_t = 2)]
    pub kns: u32,
    /// external: how long adding a KN waits for a registered KN outside the map to adopt.
    #[arg(long, default_value_t = 30_000)]
    pub adopt_timeout_ms: u64,
    /// local: the program and arguments that run a KV node, space-separated. Default: the
    /// `kv-node` subcommand of this executable when it is `dinomo`, else a `kv-node` binary
    /// beside it.
    #[arg(long)]
    pub kn_command: Option<String>,
    /// local: KN i listens on 127.0.0.1:(BASE + i).
    #[arg(long, default_value_t = 7800)]
    pub kn_port_base: u16,
    /// local: KN i serves /metrics on 127.0.0.1:(BASE + i); 0 disables.
    #[arg(long, default_value_t = 0)]
    pub kn_metrics_port_base: u16,
    /// local: one more argument for every KV node (repeatable; e.g. --kn-arg=--shards --kn-arg=2).
    #[arg(long, allow_hyphen_values = true)]
    pub kn_arg: Vec<String>,
    /// local: where KV node logs go.
    #[arg(long, default_value = ".dinomo/logs")]
    pub log_dir: PathBuf,
    /// Virtual nodes per KN on the ring of a first map.
    #[arg(long, default_value_t = 128)]
    pub vnodes: u32,
    /// Print "READY addr=<addr>" on stdout once serving (for harnesses).
    #[arg(long)]
    pub print_ready: bool,
    /// The monitor's credentials; KV nodes the local orchestrator starts get the same folder
    /// (their identity is `kn`), or `--insecure` when the monitor runs without TLS.
    #[command(flatten)]
    pub security: dinomo_security::SecurityArgs,
    #[command(flatten)]
    pub health: dinomo_node_common::health::HealthArgs,
}

/// Initialises logging to stderr.
pub fn init_tracing() {
    dinomo_node_common::init_tracing();
}

fn default_kn_command() -> anyhow::Result<Vec<String>> {
    let exe = std::env::current_exe().context("locating this executable")?;
    let name = exe.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    if name.starts_with("dinomo") {
        return Ok(vec![exe.display().to_string(), "kv-node".into()]);
    }
    let beside = exe.with_file_name("kv-node");
    Ok(vec![beside.display().to_string()])
}

/// The configuration after the file and the flags.
pub fn load_config(args: &Args) -> anyhow::Result<MonitorConfig> {
    let mut cfg = match &args.config {
        Some(p) => MonitorConfig::load(p).with_context(|| format!("reading {}", p.display()))?,
        None => MonitorConfig::default(),
    };
    if let Some(v) = &args.listen {
        cfg.server.listen = v.parse().context("--listen: not a socket address")?;
    }
    if let Some(v) = &args.advertise {
        cfg.server.advertise = v.clone();
    }
    if let Some(v) = args.orchestrator {
        cfg.orchestrator.kind = v;
    }
    if let Some(v) = &args.dpm {
        cfg.server.dpm = v.clone();
    }
    if let Some(v) = &args.metrics_listen {
        cfg.server.metrics_listen = v.clone();
    }
    if let Some(v) = args.epoch_ms {
        cfg.policy.epoch_ms = v;
    }
    if let Some(v) = args.grace_period_ms {
        cfg.policy.grace_period_ms = v;
    }
    cfg.validate().context("invalid monitor configuration")?;
    Ok(cfg)
}

/// Starts watching the dpm-node replica set (`[dpm_replicas]`) for the life of the process.
/// Before the bootstrap: on Kubernetes the DPM is reached through the primary Service, which
/// selects nothing until the watcher labels the first primary.
fn watch_dpm_replicas(
    cfg: &MonitorConfig,
    leadership: Box<dyn crate::dpm_replicas::Leadership>,
    pointer: Box<dyn crate::dpm_replicas::PrimaryPointer>,
) {
    let watcher = crate::dpm_replicas::Watcher::new(cfg.dpm_replicas.clone(), leadership, pointer);
    tokio::spawn(watcher.run());
}

/// Runs the monitor until SIGINT or SIGTERM.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let cfg = load_config(&args)?;
    let security = args
        .security
        .node("monitor", dinomo_security::Role::Monitor)?;
    security.install_for_process();
    args.health.install().context("--health-addr")?;
    dinomo_node_common::install_metrics(cfg.server.metrics_addr())?;
    let listener = tokio::net::TcpListener::bind(cfg.server.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.server.listen))?;
    let opts = MonitorOptions {
        routing: args.routing.clone(),
        drain: Duration::from_millis(args.drain_ms),
    };
    let shutdown = dinomo_node_common::shutdown_signal();
    match cfg.orchestrator.kind {
        OrchestratorKind::Local => {
            let command = match &args.kn_command {
                Some(c) => c.split_whitespace().map(str::to_string).collect(),
                None => default_kn_command()?,
            };
            let local = Arc::new(LocalOrchestrator::new(LocalConfig {
                command,
                dpm: cfg.server.dpm.clone(),
                host: "127.0.0.1".into(),
                port_base: args.kn_port_base,
                metrics_port_base: (args.kn_metrics_port_base != 0)
                    .then_some(args.kn_metrics_port_base),
                log_dir: args.log_dir.clone(),
                extra_args: {
                    let mut a = args.kn_arg.clone();
                    // Unless told otherwise (`dinomo up` names the KNs' own folder), the KNs
                    // get the monitor's folder, or --insecure like the monitor.
                    let named = a
                        .iter()
                        .any(|x| x.starts_with("--credentials") || x.starts_with("--insecure"));
                    if !named {
                        match security.identity() {
                            Some(id) => {
                                a.extend(["--credentials".into(), id.dir.display().to_string()])
                            }
                            None => a.push("--insecure".into()),
                        }
                    }
                    a
                },
                ready_timeout: Duration::from_secs(60),
                stop_timeout: Duration::from_secs(15),
            })?);
            if cfg.dpm_replicas.enabled() {
                watch_dpm_replicas(
                    &cfg,
                    Box::new(crate::dpm_replicas::Alone),
                    Box::new(crate::dpm_replicas::Unpointed),
                );
            }
            crate::server::bootstrap_local(&local, &cfg.server.dpm, args.kns, args.vnodes)
                .await
                .context("starting the KV nodes")?;
            let monitor = Monitor::new(cfg, opts, local.clone() as Arc<dyn Orchestrator>);
            if args.print_ready {
                println!("READY addr={}", listener.local_addr()?);
            }
            let r = crate::server::serve(monitor, listener, shutdown).await;
            local.stop_all().await;
            r
        }
        OrchestratorKind::Kubernetes => {
            let orch = crate::orchestrator::kubernetes::KubernetesOrchestrator::from_env(
                cfg.orchestrator.kubernetes.clone(),
            )
            .await?;
            let replicas = orch.replicas().await?;
            let orch: Arc<dyn Orchestrator> = Arc::new(orch);
            if cfg.dpm_replicas.enabled() {
                let client = kube::Client::try_default()
                    .await
                    .context("connecting to the Kubernetes API server")?;
                let pointer = crate::dpm_replicas::pod_labels::PodLabels::new(
                    client,
                    &cfg.orchestrator.kubernetes.namespace,
                    &cfg.dpm_replicas.primary_label,
                );
                watch_dpm_replicas(
                    &cfg,
                    Box::new(crate::dpm_replicas::ByOrchestrator::new(orch.clone())),
                    Box::new(pointer),
                );
            }
            crate::server::bootstrap_registered(
                &cfg.server.dpm,
                FirstMap::Ids((1..=replicas).collect()),
                args.vnodes,
            )
            .await?;
            let monitor = Monitor::new(cfg, opts, orch);
            if args.print_ready {
                println!("READY addr={}", listener.local_addr()?);
            }
            crate::server::serve(monitor, listener, shutdown).await
        }
        OrchestratorKind::External => {
            let orch = ExternalOrchestrator::new(
                cfg.server.dpm.clone(),
                Duration::from_millis(args.adopt_timeout_ms),
            );
            if cfg.dpm_replicas.enabled() {
                watch_dpm_replicas(
                    &cfg,
                    Box::new(crate::dpm_replicas::Alone),
                    Box::new(crate::dpm_replicas::Unpointed),
                );
            }
            crate::server::bootstrap_registered(
                &cfg.server.dpm,
                FirstMap::Count(args.kns.max(1) as usize),
                args.vnodes,
            )
            .await?;
            let monitor = Monitor::new(cfg, opts, Arc::new(orch));
            if args.print_ready {
                println!("READY addr={}", listener.local_addr()?);
            }
            crate::server::serve(monitor, listener, shutdown).await
        }
    }
}
