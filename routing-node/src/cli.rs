//! The routing-node's command line. Used by the `routing-node` binary and by
//! `dinomo routing-node`.

use std::time::Duration;

use anyhow::Context;
use clap::Parser;

/// A Dinomo routing node: serves the cluster map (read from the dpm-node) to clients.
#[derive(Debug, Clone, Parser)]
#[command(version, about, long_about = None)]
pub struct Args {
    /// RoutingService address.
    #[arg(long, env = "DINOMO_ROUTING_LISTEN", default_value = "127.0.0.1:7900")]
    pub listen: String,
    /// dpm-node gRPC address (the cluster map of record lives in its metadata).
    #[arg(long, env = "DINOMO_ROUTING_DPM", default_value = "127.0.0.1:7700")]
    pub dpm: String,
    /// How often the map is re-read from the DPM, in milliseconds.
    #[arg(long, env = "DINOMO_ROUTING_POLL_MS", default_value_t = 50)]
    pub poll_ms: u64,
    /// Prometheus /metrics address; "" disables it.
    #[arg(
        long,
        env = "DINOMO_ROUTING_METRICS_LISTEN",
        default_value = "127.0.0.1:9900"
    )]
    pub metrics_listen: String,
    /// Print "READY addr=<addr>" on stdout once serving (for harnesses).
    #[arg(long)]
    pub print_ready: bool,
}

/// Initialises logging to stderr (see [`dinomo_node_common::init_tracing`]).
pub fn init_tracing() {
    dinomo_node_common::init_tracing();
}

/// Runs the routing node until SIGINT or SIGTERM.
pub async fn run(args: Args) -> anyhow::Result<()> {
    let metrics = if args.metrics_listen.is_empty() {
        None
    } else {
        Some(
            args.metrics_listen
                .parse()
                .context("--metrics-listen: not a socket address")?,
        )
    };
    dinomo_node_common::install_metrics(metrics)?;
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    if args.print_ready {
        println!("READY addr={}", listener.local_addr()?);
    }
    let dpm = if args.dpm.starts_with("http") {
        args.dpm
    } else {
        format!("http://{}", args.dpm)
    };
    let shutdown = dinomo_node_common::shutdown_signal();
    crate::run(
        listener,
        dpm,
        Duration::from_millis(args.poll_ms.max(1)),
        shutdown,
    )
    .await
}
