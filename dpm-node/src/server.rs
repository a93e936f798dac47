//! Runs a whole dpm-node: opens the DPM, starts the fabric NIC (tcp), the gRPC service and the
//! metrics endpoint, and stops cleanly on a shutdown signal.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use dinomo_fabric::tcp::TcpNic;
use dinomo_proto::dpm::dpm_service_server::DpmServiceServer;

use crate::config::{DpmConfig, FabricKind};
use crate::dpm::Dpm;
use crate::error::{DpmError, Result};
use crate::service::DpmGrpc;

/// A running node's addresses (ports resolved when the config asked for port 0).
#[derive(Debug, Clone)]
pub struct Running {
    pub grpc: SocketAddr,
    pub fabric: SocketAddr,
}

/// Serves until `shutdown` completes. `ready` is called once every listener is bound.
pub async fn run(
    config: DpmConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    ready: impl FnOnce(&Running) + Send,
) -> Result<()> {
    let dpm = tokio::task::spawn_blocking(move || Dpm::open(config))
        .await
        .map_err(|e| DpmError::Config(format!("opening the DPM panicked: {e}")))??;
    let nic = TcpNic::start(
        dpm.config.fabric_listen,
        dpm.pool().region().clone(),
        dpm.grants().clone(),
    )
    .await?;
    let fabric_address = match dpm.config.fabric {
        FabricKind::Shm => dpm.config.pool_path.canonicalize()?.display().to_string(),
        FabricKind::Tcp => nic.local_addr().to_string(),
    };
    let listener = tokio::net::TcpListener::bind(dpm.config.listen)
        .await
        .map_err(|e| DpmError::Config(format!("cannot listen on {}: {e}", dpm.config.listen)))?;
    let running = Running {
        grpc: listener.local_addr()?,
        fabric: nic.local_addr(),
    };
    tracing::info!(grpc = %running.grpc, fabric = %running.fabric, kind = ?dpm.config.fabric, "dpm-node serving");
    ready(&running);

    let gauges = tokio::spawn(export_gauges(dpm.clone()));
    let svc = DpmServiceServer::new(DpmGrpc::new(dpm.clone(), dpm.config.fabric, fabric_address))
        .max_decoding_message_size(16 << 20);
    // Graceful shutdown waits for open connections; clients that keep theirs open get a short
    // grace period, then the server stops anyway.
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        let _ = stopping_tx.send(());
    };
    let serve = tonic::transport::Server::builder()
        .add_service(svc)
        .serve_with_incoming_shutdown(dinomo_proto::nodelay_incoming(listener), signal);
    let served = tokio::select! {
        r = serve => r,
        _ = async {
            let _ = stopping_rx.await;
            tokio::time::sleep(Duration::from_secs(2)).await;
        } => {
            tracing::info!("connections still open after the grace period; stopping anyway");
            Ok(())
        }
    };
    gauges.abort();
    drop(nic);
    let d = dpm.clone();
    tokio::task::spawn_blocking(move || d.shutdown()).await.ok();
    served.map_err(|e| DpmError::Config(format!("gRPC server failed: {e}")))?;
    tracing::info!("dpm-node stopped");
    Ok(())
}

async fn export_gauges(dpm: Arc<Dpm>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let s = dpm.stats();
        metrics::gauge!("dinomo_dpm_segments_total").set(s.segments_total as f64);
        metrics::gauge!("dinomo_dpm_segments_free").set(s.segments_free as f64);
        metrics::gauge!("dinomo_dpm_index_items").set(s.index_items as f64);
        metrics::gauge!("dinomo_dpm_index_buckets").set(s.index_buckets as f64);
        metrics::gauge!("dinomo_dpm_pending_segments")
            .set(s.pending_segments.values().sum::<u64>() as f64);
    }
}
