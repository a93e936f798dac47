//! The kv-node binary: flags and config file -> [`dinomo_kv_node::server::run`].

use std::path::PathBuf;

use anyhow::Context;
use clap::Parser;
use dinomo_kv_node::config::KnConfigFile;

/// A Dinomo KV node: owns key ranges, caches values and shortcuts (DAC), and writes batched
/// logs to the dpm-node with one-sided operations.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Args {
    /// Configuration file (TOML; see config/kv-node.toml). Without it, defaults apply.
    #[arg(long, short, env = "DINOMO_KN_CONFIG")]
    config: Option<PathBuf>,
    /// KN id to register as (overrides kn_id).
    #[arg(long, env = "DINOMO_KN_ID")]
    kn_id: Option<u32>,
    /// KvService address (overrides listen).
    #[arg(long, env = "DINOMO_KN_LISTEN")]
    listen: Option<String>,
    /// dpm-node gRPC address (overrides dpm).
    #[arg(long, env = "DINOMO_KN_DPM")]
    dpm: Option<String>,
    /// Worker shards (overrides shards).
    #[arg(long, env = "DINOMO_KN_SHARDS")]
    shards: Option<u32>,
    /// Cache size, e.g. 64MiB (overrides cache_size).
    #[arg(long, env = "DINOMO_KN_CACHE_SIZE")]
    cache_size: Option<String>,
    /// dac | shortcut-only | value-only | static-N (overrides cache_policy).
    #[arg(long, env = "DINOMO_KN_CACHE_POLICY")]
    cache_policy: Option<String>,
    /// Metrics address, "" to disable (overrides metrics_listen).
    #[arg(long, env = "DINOMO_KN_METRICS_LISTEN")]
    metrics_listen: Option<String>,
    /// Print "READY addr=<addr> kn=<id>" on stdout once serving (for harnesses).
    #[arg(long)]
    print_ready: bool,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DINOMO_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let mut file = match &args.config {
        Some(p) => KnConfigFile::from_toml(
            &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        )
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("parsing {}", p.display()))?,
        None => KnConfigFile::default(),
    };
    if args.kn_id.is_some() {
        file.kn_id = args.kn_id;
    }
    if let Some(v) = args.listen {
        file.listen = v;
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
    let config = file
        .validate()
        .map_err(anyhow::Error::msg)
        .context("invalid configuration")?;
    if let Some(addr) = config.metrics_listen {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .with_context(|| format!("starting the metrics endpoint on {addr}"))?;
    }
    let print_ready = args.print_ready;
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        tracing::info!("shutting down");
    };
    dinomo_kv_node::server::run(config, shutdown, |r| {
        if print_ready {
            println!("READY addr={} kn={} epoch={}", r.addr, r.kn_id, r.epoch);
        }
    })
    .await?;
    Ok(())
}
