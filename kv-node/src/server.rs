//! Runs a kv-node: starts the node, serves KvService, stops on a shutdown signal. A stop seals
//! the node's logs ([`KvNode::shutdown`]) before [`run`] returns.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use dinomo_proto::kv::kv_service_server::KvServiceServer;

use crate::config::KnConfig;
use crate::error::{KvError, KvResult};
use crate::node::KvNode;
use crate::service::KvGrpc;

#[derive(Debug, Clone)]
pub struct Running {
    pub addr: SocketAddr,
    pub kn_id: u32,
    pub epoch: u64,
}

/// Serves until `shutdown` completes. `ready` is called once serving.
pub async fn run(
    mut config: KnConfig,
    shutdown: impl Future<Output = ()> + Send + 'static,
    ready: impl FnOnce(&Running) + Send,
) -> KvResult<()> {
    let listener = tokio::net::TcpListener::bind(config.listen)
        .await
        .map_err(|e| KvError::Unavailable(format!("cannot listen on {}: {e}", config.listen)))?;
    let addr = listener
        .local_addr()
        .map_err(|e| KvError::Internal(e.to_string()))?;
    config.advertise =
        dinomo_node_common::address::advertise_address("kv-node", addr, &config.advertise_setting)
            .map_err(KvError::InvalidArgument)?;
    tracing::info!(listen = %addr, advertise = %config.advertise, "kv-node address");
    let node = KvNode::start(config).await?;
    let running = Running {
        addr,
        kn_id: node.kn_id(),
        epoch: node.epoch(),
    };
    tracing::info!(%addr, kn = running.kn_id, epoch = running.epoch, "kv-node serving");
    ready(&running);
    // Ready for a probe once registered (done: KvNode::start), with a healthy DPM session and
    // a cluster map.
    let (health, health_service) = dinomo_node_common::health::Health::new().await;
    let shutdown = health.on_shutdown(shutdown);
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    let (streams_stop, streams_stopping) = tokio::sync::watch::channel(false);
    let signal = async move {
        shutdown.await;
        // Clients hold their Pipeline streams open for good: end them (once their requests
        // in flight are answered) so that the graceful shutdown can finish.
        let _ = streams_stop.send(true);
        let _ = stopping_tx.send(());
    };
    let probed = node.clone();
    let health_task = health.follow("kv-node", move || {
        probed.session_healthy() && probed.map().version > 0
    });
    let security = node.config.security.clone();
    security.warn_if_insecure("kv-node", addr);
    let serve = security
        .server_builder()
        .map_err(|e| KvError::Internal(format!("TLS: {e}")))?
        .add_service(health_service)
        .add_service(
            KvServiceServer::new(KvGrpc::with_shutdown(node.clone(), streams_stopping))
                .max_decoding_message_size(64 << 20),
        )
        .serve_with_incoming_shutdown(dinomo_proto::nodelay_incoming(listener), signal);
    let served = tokio::select! {
        r = serve => r,
        _ = async {
            let _ = stopping_rx.await;
            tokio::time::sleep(Duration::from_secs(2)).await;
        } => Ok(()),
    };
    health_task.abort();
    // Seal the logs before returning: the runtime may be torn down right after.
    node.shutdown().await;
    drop(node);
    served.map_err(|e| KvError::Internal(format!("gRPC server failed: {e}")))?;
    tracing::info!("kv-node stopped");
    Ok(())
}
