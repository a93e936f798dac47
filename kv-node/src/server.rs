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

/// How long a stopping KN waits for its KV wire connections to end (each reads for at most 2 s
/// after its goodbye, then writes what it owes).
const WIRE_DRAIN: Duration = Duration::from_secs(4);

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
    // One port for gRPC and the KV wire (listener.rs): this node accepts and, with
    // credentials, does the TLS handshake itself, then hands gRPC connections to tonic.
    let tls = security
        .rustls_server(&[dinomo_security::ALPN_H2, dinomo_proto::wire::ALPN])
        .map_err(|e| KvError::Internal(format!("TLS: {e}")))?;
    let router = security
        .server_builder_for_own_tls()
        .add_service(health_service)
        .add_service(
            KvServiceServer::new(KvGrpc::with_shutdown(
                node.clone(),
                streams_stopping.clone(),
            ))
            .max_decoding_message_size(64 << 20),
        );
    // Closed once the accept loop and every connection it started have ended.
    let (alive, mut wire_done) = tokio::sync::mpsc::channel::<()>(1);
    let serve: std::pin::Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>> =
        match tls {
            None => Box::pin(router.serve_with_incoming_shutdown(
                crate::listener::plain(listener, node.clone(), streams_stopping, alive),
                signal,
            )),
            Some(tls) => Box::pin(router.serve_with_incoming_shutdown(
                crate::listener::tls(listener, tls, node.clone(), streams_stopping, alive),
                signal,
            )),
        };
    let served = tokio::select! {
        r = serve => r,
        _ = async {
            let _ = stopping_rx.await;
            tokio::time::sleep(Duration::from_secs(2)).await;
        } => Ok(()),
    };
    // KV wire connections say goodbye, answer what they read and end (each within its drain
    // limit): wait for them before the node stops, or the answers they still owe would die
    // with the process.
    if tokio::time::timeout(WIRE_DRAIN, wire_done.recv())
        .await
        .is_err()
    {
        tracing::warn!("KV wire connections still open after {WIRE_DRAIN:?}; stopping anyway");
    }
    health_task.abort();
    // Seal the logs before returning: the runtime may be torn down right after.
    node.shutdown().await;
    drop(node);
    served.map_err(|e| KvError::Internal(format!("gRPC server failed: {e}")))?;
    tracing::info!("kv-node stopped");
    Ok(())
}
