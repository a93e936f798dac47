//! Running the monitor: bootstrapping a local cluster's KNs and serving MonitorService.

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context;
use dinomo_client::admin;
use dinomo_placement::{ClusterMap, KnInfo};
use dinomo_proto::monitor::monitor_service_server::MonitorServiceServer;

use crate::orchestrator::local::LocalOrchestrator;
use crate::service::Service;
use crate::Monitor;

/// Starts the KNs of a local cluster and makes sure the map of record names them.
///
/// - A reconfiguration of an earlier run left unfinished: resolved first
///   (`admin::resolve_unfinished`).
/// - No map published yet: starts KNs 1..=`kns` and publishes the first map.
/// - A map from an earlier run: restarts its KNs (same ids, so each one's previous incarnation
///   is merged and fenced at registration), republishes it if their endpoints changed, then adds
///   KNs (by reconfiguration) until there are `kns`.
///
/// It runs before the monitor leads, so its DPM calls carry no monitor term; every publish is
/// still a compare-and-swap (the first only if no map exists, later ones over the map read).
pub async fn bootstrap_local(
    orch: &LocalOrchestrator,
    dpm: &str,
    kns: u32,
    vnodes: u32,
) -> anyhow::Result<ClusterMap> {
    use crate::orchestrator::Orchestrator;
    // A change the previous run left unfinished is settled first (its KNs are not running:
    // they are fenced and merged if it is finished); otherwise the reconfigurations below
    // would be refused while it is recorded.
    if let Some(r) = admin::resolve_unfinished(dpm, &admin::Unled).await? {
        tracing::warn!(resolution = ?r, "a reconfiguration of an earlier run was resolved");
    }
    let published = admin::published_map(dpm).await?;
    let mut map = match published {
        None => {
            let mut infos = Vec::new();
            for id in 1..=kns.max(1) {
                infos.push(orch.start_kn(id).await?);
            }
            let map = ClusterMap::new(infos, vnodes, 1)?;
            admin::publish_map(dpm, &map).await?;
            tracing::info!(
                version = map.version,
                kns = map.kns.len(),
                "first cluster map published"
            );
            return Ok(map);
        }
        Some(m) => m,
    };
    let max_id = map.kn_ids().max().unwrap_or(0);
    orch.reserve_ids_up_to(max_id).await;
    let mut infos: Vec<KnInfo> = Vec::new();
    for id in map.kn_ids().collect::<Vec<_>>() {
        infos.push(orch.start_kn(id).await?);
    }
    if infos != map.kns {
        // Same ids, new endpoints (another port base): nobody serves the old ones any more.
        let mut next = map.clone();
        next.kns = infos;
        next.version += 1;
        next.validate()?;
        admin::replace_map(dpm, &map, &next).await?;
        map = next;
    }
    while (map.kns.len() as u32) < kns {
        let info = orch.add_kn().await?;
        let next = map.with_kn_added(info)?;
        admin::reconfigure(dpm, &map, &next).await?;
        map = next;
    }
    tracing::info!(
        version = map.version,
        kns = map.kns.len(),
        "cluster map of an earlier run resumed"
    );
    Ok(map)
}

/// Serves MonitorService on `listener` and runs the monitor's loops until `shutdown`.
pub async fn serve(
    monitor: Arc<Monitor>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let addr: SocketAddr = listener.local_addr()?;
    monitor.spawn_loops();
    tracing::info!(%addr, orchestrator = monitor.orchestrator().name(), "monitor serving");
    // Healthy once serving, leader or standby (the cluster map was resumed or published
    // before serve() is called).
    let (health, health_service) = dinomo_node_common::health::Health::new().await;
    health.set(true).await;
    let shutdown = health.on_shutdown(shutdown);
    tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(MonitorServiceServer::new(Service::new(monitor)))
        .serve_with_incoming_shutdown(dinomo_proto::nodelay_incoming(listener), shutdown)
        .await
        .context("serving MonitorService")
}
