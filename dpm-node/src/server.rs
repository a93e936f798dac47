//! Runs a whole dpm-node: opens the DPM, starts the fabric NIC (only when the fabric is tcp),
//! the gRPC service and the metrics endpoint, and stops cleanly on a shutdown signal.

use std::fmt;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
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
    /// Where KNs reach the fabric this node serves.
    pub fabric: FabricEndpoint,
}

/// The fabric a node serves, as KNs are told to reach it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FabricEndpoint {
    /// KNs map the pool file at this path themselves; no NIC runs.
    Shm(PathBuf),
    /// The address of the tcp fabric NIC.
    Tcp(SocketAddr),
}

impl FabricEndpoint {
    /// The NIC's address, if this node serves the tcp fabric.
    pub fn tcp(&self) -> Option<SocketAddr> {
        match self {
            FabricEndpoint::Tcp(a) => Some(*a),
            FabricEndpoint::Shm(_) => None,
        }
    }
}

/// `shm:<pool path>` or the NIC's `host:port` (what the READY line prints after `fabric=`).
impl fmt::Display for FabricEndpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FabricEndpoint::Shm(p) => write!(f, "shm:{}", p.display()),
            FabricEndpoint::Tcp(a) => write!(f, "{a}"),
        }
    }
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
    // The tcp NIC runs only when KNs are told to use it: with shm, KNs map the pool and a
    // listening NIC would be an unused door into the pool.
    let (nic, fabric) = match dpm.config.fabric {
        FabricKind::Shm => {
            let pool = dpm.config.pool_path.canonicalize()?;
            tracing::info!(pool = %pool.display(), "fabric: shm (KNs map the pool); the tcp NIC is not started");
            (None, FabricEndpoint::Shm(pool))
        }
        FabricKind::Tcp => {
            let nic = TcpNic::start(
                dpm.config.fabric_listen,
                dpm.pool().region().clone(),
                dpm.grants().clone(),
            )
            .await?;
            tracing::info!(nic = %nic.local_addr(), "fabric: tcp (the NIC serves the pool)");
            let addr = nic.local_addr();
            (Some(nic), FabricEndpoint::Tcp(addr))
        }
    };
    let fabric_address = match &fabric {
        FabricEndpoint::Shm(pool) => pool.display().to_string(),
        FabricEndpoint::Tcp(addr) => dinomo_node_common::address::advertise_address(
            "fabric_advertise",
            *addr,
            &dpm.config.fabric_advertise,
        )
        .map_err(DpmError::Config)?,
    };
    tracing::info!(fabric = %fabric_address, "KNs are told to reach the fabric here");
    let listener = tokio::net::TcpListener::bind(dpm.config.listen)
        .await
        .map_err(|e| DpmError::Config(format!("cannot listen on {}: {e}", dpm.config.listen)))?;
    let running = Running {
        grpc: listener.local_addr()?,
        fabric,
    };
    tracing::info!(grpc = %running.grpc, fabric = %running.fabric, kind = ?dpm.config.fabric, "dpm-node serving");
    ready(&running);

    let nic = nic.map(Arc::new);
    let gauges = tokio::spawn(export_gauges(dpm.clone(), nic.clone()));
    let svc = DpmServiceServer::new(DpmGrpc::new(dpm.clone(), dpm.config.fabric, fabric_address))
        .max_decoding_message_size(16 << 20);
    // Graceful shutdown waits for open connections; clients that keep theirs open get a short
    // grace period, then the server stops anyway.
    // The pool is open and every listener bound: the node can do its job from now on.
    let (health, health_service) = dinomo_node_common::health::Health::new().await;
    health.set(true).await;
    let shutdown = health.on_shutdown(shutdown);
    let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        let _ = stopping_tx.send(());
    };
    let serve = tonic::transport::Server::builder()
        .add_service(health_service)
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
    let _ = gauges.await; // releases its handle on the NIC
    drop(nic);
    let d = dpm.clone();
    tokio::task::spawn_blocking(move || d.shutdown()).await.ok();
    served.map_err(|e| DpmError::Config(format!("gRPC server failed: {e}")))?;
    tracing::info!("dpm-node stopped");
    Ok(())
}

async fn export_gauges(dpm: Arc<Dpm>, nic: Option<Arc<TcpNic>>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        if let Some(n) = &nic {
            metrics::counter!("dinomo_fabric_tcp_bad_frames_total").absolute(n.bad_frames());
        }
        let s = dpm.stats();
        metrics::gauge!("dinomo_dpm_segments_total").set(s.segments_total as f64);
        metrics::gauge!("dinomo_dpm_segments_free").set(s.segments_free as f64);
        metrics::gauge!("dinomo_dpm_index_items").set(s.index_items as f64);
        metrics::gauge!("dinomo_dpm_index_buckets").set(s.index_buckets as f64);
        metrics::gauge!("dinomo_dpm_index_bytes").set(s.index_space.bytes as f64);
        metrics::gauge!("dinomo_dpm_live_log_bytes").set(s.live_log_bytes as f64);
        metrics::gauge!("dinomo_dpm_segments_reserved").set(s.segments_reserved as f64);
        metrics::gauge!("dinomo_dpm_pending_segments")
            .set(s.pending_segments.values().sum::<u64>() as f64);
    }
}
