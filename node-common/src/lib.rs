//! dinomo-node-common: the process plumbing every Dinomo node shares, so that the dpm-node, the
//! KV nodes and the routing nodes log, expose metrics and stop in the same way, and the one way
//! to start a node process and wait for its READY line ([`spawn`]).

use std::net::SocketAddr;

use anyhow::Context;

pub mod address;
pub mod config;
pub mod health;
pub mod process;
pub mod spawn;

pub use spawn::{
    ready_field, spawn_until_ready, spawn_until_ready_async, wait_for_line, SpawnError,
};

/// Logs to stderr, filtered by `DINOMO_LOG` (an EnvFilter string, default `info`). Calling it
/// twice is harmless (the `dinomo` binary may run a node after initialising).
pub fn init_tracing() {
    init_tracing_or("info")
}

/// [`init_tracing`] with another default filter (`warn` for the client commands). Every
/// command installs one: without a subscriber, the `log` feature of `tracing` (turned on by
/// kube-client) sends each of h2's spans through `log`, measured at 12 % of a benchmark
/// client's instructions (docs/perf/request-path-profile.md).
pub fn init_tracing_or(default_filter: &str) {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("DINOMO_LOG")
                .unwrap_or_else(|_| default_filter.into()),
        )
        .with_writer(std::io::stderr)
        .try_init()
        .ok();
}

/// A multi-thread tokio runtime with `worker_threads` threads (`None`: one per core), for
/// the processes whose thread count is a flag (`kv-node --worker-threads`, `bench --threads`).
pub fn runtime(worker_threads: Option<u16>) -> std::io::Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    b.enable_all();
    if let Some(n) = worker_threads {
        b.worker_threads(n.into());
    }
    b.build()
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

/// Parses a size: a number with an optional binary unit, "64KiB", "8MiB", "1GiB", "512" (bytes);
/// K/KB, M/MB, G/GB, T/TB are read as the binary units too.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("size {s:?}: expected a number with an optional unit like 8MiB"))?;
    let mult: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" | "K" | "KB" => 1 << 10,
        "MiB" | "M" | "MB" => 1 << 20,
        "GiB" | "G" | "GB" => 1 << 30,
        "TiB" | "T" | "TB" => 1 << 40,
        u => {
            return Err(format!(
                "size {s:?}: unknown unit {u:?} (use B, KiB, MiB, GiB, TiB)"
            ))
        }
    };
    n.checked_mul(mult)
        .ok_or_else(|| format!("size {s:?} overflows"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn sizes() {
        assert_eq!(super::parse_size("8MiB"), Ok(8 << 20));
        assert_eq!(super::parse_size(" 512 "), Ok(512));
        assert_eq!(super::parse_size("2G"), Ok(2 << 30));
        assert!(super::parse_size("8 parsecs").is_err());
        assert!(super::parse_size("").is_err());
        assert!(super::parse_size("99999999999TiB").is_err());
    }
}
