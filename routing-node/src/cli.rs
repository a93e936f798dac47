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

/// Initialises logging to stderr (DINOMO_LOG; default info).
pub fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DINOMO_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .try_init()
        .ok();
}

/// Runs the routing node until SIGINT or SIGTERM.
pub async fn run(args: Args) -> anyhow::Result<()> {
    if !args.metrics_listen.is_empty() {
        let addr: std::net::SocketAddr = args.metrics_listen.parse().context("--metrics-listen")?;
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .with_context(|| format!("starting the metrics endpoint on {addr}"))?;
    }
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
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    crate::run(
        listener,
        dpm,
        Duration::from_millis(args.poll_ms.max(1)),
        shutdown,
    )
    .await
}
