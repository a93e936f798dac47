//! dinomo-node-common: the process plumbing every Dinomo node shares, so that the dpm-node, the
//! KV nodes and the routing nodes log, expose metrics and stop in the same way.

use std::net::SocketAddr;

use anyhow::Context;

/// Logs to stderr, filtered by `DINOMO_LOG` (an EnvFilter string, default `info`). Calling it
/// twice is harmless (the `dinomo` binary may run a node after initialising).
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

/// Serves Prometheus metrics at `http://addr/metrics` (nothing when `addr` is `None`).
pub fn install_metrics(addr: Option<SocketAddr>) -> anyhow::Result<()> {
    if let Some(addr) = addr {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .with_context(|| format!("starting the metrics endpoint on {addr}"))?;
        tracing::info!(%addr, "metrics at http://{addr}/metrics");
    }
    Ok(())
}

/// Completes on SIGINT (Ctrl-C) or SIGTERM.
pub async fn shutdown_signal() {
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "no SIGTERM handler; stopping on Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    tracing::info!("shutting down");
}
