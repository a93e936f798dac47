//! Running the monitor: bootstrapping the first cluster map (starting a local cluster's KNs,
//! or waiting for KNs that someone else starts to register) and serving MonitorService.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use dinomo_client::admin;
use dinomo_node_common::health;
use dinomo_placement::{ClusterMap, KnId, KnInfo};
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

/// Which KNs the first map of a cluster names when someone else starts its KNs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FirstMap {
    /// Exactly these ids (kubernetes: the StatefulSet's pods, ids 1..=replicas).
    Ids(Vec<KnId>),
    /// The lowest `n` ids that answer (external).
    Count(usize),
}

/// How often [`bootstrap_registered`] looks again while it waits.
const BOOTSTRAP_POLL: Duration = Duration::from_secs(1);
/// How often it says what it waits for.
const BOOTSTRAP_LOG_EVERY: Duration = Duration::from_secs(10);

/// Makes sure a cluster whose KNs are started by someone else (kubernetes, external) has a map
/// of record: returns the published map if there is one; otherwise waits until the KNs that
/// `first` names have registered with the DPM and answer their health check (a KN reports
/// NOT_SERVING until a map exists, but it answers), then publishes the first map with them.
///
/// Several monitors may run this at once (kubernetes runs two): the publish is a
/// compare-and-swap over "no map", so one map wins and the others return it. Until the DPM can
/// be reached and the KNs are there, it retries and says what it waits for; it never gives up
/// (a pod that exits would only be restarted to wait again).
pub async fn bootstrap_registered(
    dpm: &str,
    first: FirstMap,
    vnodes: u32,
) -> anyhow::Result<ClusterMap> {
    let started = Instant::now();
    let mut said = None::<Instant>;
    loop {
        let waiting = match first_map_round(dpm, &first).await {
            Ok(Round::Published(map)) => return Ok(map),
            Ok(Round::Ready(kns)) => {
                let map = ClusterMap::new(kns, vnodes, 1)?;
                match admin::publish_map(dpm, &map).await {
                    Ok(()) => {
                        tracing::info!(
                            version = map.version,
                            kns = ?map.kn_ids().collect::<Vec<_>>(),
                            "first cluster map published with the registered KNs"
                        );
                        return Ok(map);
                    }
                    // Another monitor published first: its map is returned next round.
                    Err(e) => format!("publishing the first map: {e}"),
                }
            }
            Ok(Round::Waiting) => format!("KNs to register and answer ({first:?})"),
            Err(e) => format!("{e:#}"),
        };
        if said.is_none_or(|t| t.elapsed() >= BOOTSTRAP_LOG_EVERY) {
            tracing::info!(
                waited_s = started.elapsed().as_secs(),
                waiting_for = %waiting,
                "no cluster map yet: waiting before publishing the first one"
            );
            said = Some(Instant::now());
        }
        tokio::time::sleep(BOOTSTRAP_POLL).await;
    }
}

/// What one round of [`bootstrap_registered`] found.
enum Round {
    /// A map is published.
    Published(ClusterMap),
    /// No map, and these are the KNs of the first one.
    Ready(Vec<KnInfo>),
    /// No map, and not all of its KNs are there yet.
    Waiting,
}

async fn first_map_round(dpm: &str, first: &FirstMap) -> anyhow::Result<Round> {
    if let Some(map) = admin::published_map(dpm).await? {
        return Ok(Round::Published(map));
    }
    let registered = admin::registered_kns(dpm).await?;
    let wanted: Vec<KnInfo> = match first {
        FirstMap::Ids(ids) => registered
            .into_iter()
            .filter(|k| ids.contains(&k.id))
            .collect(),
        FirstMap::Count(_) => registered,
    };
    let answers = futures::future::join_all(wanted.iter().map(|k| {
        health::check(
            &k.endpoint,
            dinomo_security::Service::Kv,
            crate::orchestrator::external::PROBE_TIMEOUT,
        )
    }))
    .await;
    let alive: Vec<KnInfo> = wanted
        .into_iter()
        .zip(answers)
        .filter(|(_, a)| a.is_ok())
        .map(|(k, _)| k)
        .collect();
    let ready = match first {
        FirstMap::Ids(ids) => !ids.is_empty() && alive.len() == ids.len(),
        FirstMap::Count(n) => *n > 0 && alive.len() >= *n,
    };
    Ok(match first {
        _ if !ready => Round::Waiting,
        FirstMap::Ids(_) => Round::Ready(alive),
        FirstMap::Count(n) => Round::Ready(alive[..*n].to_vec()),
    })
}

/// Serves MonitorService on `listener` and runs the monitor's loops until `shutdown`.
pub async fn serve(
    monitor: Arc<Monitor>,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let addr: SocketAddr = listener.local_addr()?;
    monitor.advertise(addr);
    monitor.spawn_loops();
    tracing::info!(%addr, orchestrator = monitor.orchestrator().name(), "monitor serving");
    // Healthy once serving, leader or standby (the cluster map was resumed or published
    // before serve() is called).
    let (health, health_service) = dinomo_node_common::health::Health::new().await;
    health.set(true).await;
    let shutdown = health.on_shutdown(shutdown);
    let security = dinomo_security::Security::of_process();
    security.warn_if_insecure("monitor", addr);
    security
        .server_builder()?
        .add_service(health_service)
        .add_service(MonitorServiceServer::new(Service::new(monitor)))
        .serve_with_incoming_shutdown(dinomo_proto::nodelay_incoming(listener), shutdown)
        .await
        .context("serving MonitorService")
}
