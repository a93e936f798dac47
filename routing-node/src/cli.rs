//! The routing-node's command line. Used by the `routing-node` binary and by
//! `dinomo routing-node`. Flag over file over default ([`dinomo_node_common::config`]).

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;

use crate::config::RoutingConfig;

/// A Dinomo routing node: serves the cluster map (read from the dpm-node) to clients.
#[derive(Debug, Clone, Parser)]
#[command(version, about, long_about = None)]
pub struct Args {
    /// Configuration file (TOML; see config/routing-node.toml). Without it, defaults apply.
    #[arg(long, short, env = "DINOMO_ROUTING_CONFIG")]
    pub config: Option<PathBuf>,
    /// RoutingService address (overrides listen; default 127.0.0.1:7900).
    #[arg(long, env = "DINOMO_ROUTING_LISTEN")]
    pub listen: Option<String>,
    /// dpm-node gRPC address, where the cluster map of record lives (overrides dpm; default
    /// 127.0.0.1:7700).
    #[arg(long, env = "DINOMO_ROUTING_DPM")]
    pub dpm: Option<String>,
    /// How often the map is re-read from the dpm-node, in milliseconds (overrides poll_ms;
    /// default 50).
    #[arg(long, env = "DINOMO_ROUTING_POLL_MS")]
    pub poll_ms: Option<u64>,
    /// Prometheus /metrics address; "" disables it (overrides metrics_listen; default
    /// 127.0.0.1:9900).
    #[arg(long, env = "DINOMO_ROUTING_METRICS_LISTEN")]
    pub metrics_listen: Option<String>,
    /// Print "READY addr=<addr>" on stdout once serving (for harnesses).
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

/// The configuration after the file and the flags, validated.
pub fn load_config(args: &Args) -> anyhow::Result<RoutingConfig> {
    let mut cfg: RoutingConfig = dinomo_node_common::config::load_toml(args.config.as_deref())?;
    if let Some(v) = &args.listen {
        cfg.listen = v.clone();
    }
    if let Some(v) = &args.dpm {
        cfg.dpm = v.clone();
    }
    if let Some(v) = args.poll_ms {
        cfg.poll_ms = v;
    }
    if let Some(v) = &args.metrics_listen {
        cfg.metrics_listen = v.clone();
    }
    cfg.validate()
        .context("invalid routing-node configuration")?;
    Ok(cfg)
}

/// Runs the routing node until SIGINT or SIGTERM.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let cfg = load_config(&args)?;
    let security = args.security.node("routing", dinomo_security::Role::Node)?;
    security.install_for_process();
    args.health.install().context("--health-addr")?;
    dinomo_node_common::install_metrics(cfg.metrics_addr()?)?;
    let listener = tokio::net::TcpListener::bind(&cfg.listen)
        .await
        .with_context(|| format!("cannot listen on {}", cfg.listen))?;
    if args.print_ready {
        println!("READY addr={}", listener.local_addr()?);
    }
    let shutdown = dinomo_node_common::shutdown_signal();
    crate::run(listener, cfg.dpm_url(), cfg.poll(), security, shutdown).await
}
