//! dinomo-routing-node: serves the cluster map to clients. Stateless: the map of record is the
//! DPM's metadata "cluster/map", polled every `poll` (and any number of routing nodes can run).
//! `GetClusterMap` answers with the newest map seen; `WatchClusterMap` streams each newer one.
//!
//! Invariant: the served version never goes backwards (a poll that returns an older or equal
//! version is ignored).
//!
//! Each poll also reads the leading monitor's address (metadata
//! [`dinomo_proto::MONITOR_ENDPOINT_KEY`]), handed to clients with the map so that they report
//! their latencies to it without being configured with it.

pub mod cli;
pub mod config;

use std::net::SocketAddr;
use std::pin::Pin;
use std::time::Duration;

use dinomo_placement::ClusterMap;
use dinomo_proto::dpm::dpm_service_client::DpmServiceClient;
use dinomo_proto::dpm::GetMetadataRequest;
use dinomo_proto::routing as pb;
use dinomo_proto::routing::routing_service_server::{RoutingService, RoutingServiceServer};
use tokio::sync::watch;
use tokio_stream::Stream;
use tonic::{Request, Response, Status};

/// The metadata name of the cluster map of record.
pub const CLUSTER_MAP_KEY: &str = "cluster/map";

/// The newest map known: (version, encoded map). Version 0 = none published yet.
type Current = (u64, Vec<u8>);

#[derive(Debug, Clone)]
pub struct Routing {
    current: watch::Receiver<Current>,
    /// The leading monitor's MonitorService address; empty: none published.
    monitor: watch::Receiver<String>,
}

fn reply((version, map): Current, monitor: &watch::Receiver<String>) -> pb::ClusterMapReply {
    pb::ClusterMapReply {
        version,
        map,
        monitor: monitor.borrow().clone(),
    }
}

/// Polls the DPM for the map of record and publishes newer versions on `tx`, and the monitor's
/// address on `monitor`.
pub async fn poll_dpm(
    security: dinomo_security::Security,
    dpm: String,
    poll: Duration,
    tx: watch::Sender<Current>,
    monitor: watch::Sender<String>,
) {
    let mut client: Option<DpmServiceClient<tonic::transport::Channel>> = None;
    let mut warned = false;
    loop {
        if client.is_none() {
            client = match security.endpoint(&dpm, dinomo_security::Service::Dpm) {
                Ok(ep) => ep.connect().await.ok().map(DpmServiceClient::new),
                Err(e) => {
                    tracing::error!(error = %e, "bad dpm-node address");
                    None
                }
            };
        }
        if let Some(c) = client.as_mut() {
            match c
                .get_metadata(GetMetadataRequest {
                    name: CLUSTER_MAP_KEY.into(),
                })
                .await
            {
                Ok(r) => {
                    warned = false;
                    if let Some(bytes) = r.into_inner().value {
                        match ClusterMap::decode(&bytes) {
                            Ok(m) if m.version > tx.borrow().0 => {
                                tracing::info!(
                                    version = m.version,
                                    kns = m.kns.len(),
                                    "serving a new cluster map"
                                );
                                metrics::gauge!("dinomo_routing_map_version").set(m.version as f64);
                                let _ = tx.send((m.version, bytes));
                            }
                            Ok(_) => {}
                            Err(e) => {
                                tracing::warn!(error = %e, "the published cluster map does not decode")
                            }
                        }
                    }
                }
                Err(e) => {
                    if !warned {
                        tracing::warn!(error = %e, %dpm, "cannot read the cluster map from the DPM; retrying");
                        warned = true;
                    }
                    client = None;
                }
            }
        }
        if let Some(c) = client.as_mut() {
            // A failed read keeps the address last seen: a monitor does not move often, and a
            // stale address costs only undelivered latency reports.
            if let Ok(r) = c
                .get_metadata(GetMetadataRequest {
                    name: dinomo_proto::MONITOR_ENDPOINT_KEY.into(),
                })
                .await
            {
                let addr = r
                    .into_inner()
                    .value
                    .and_then(|v| String::from_utf8(v).ok())
                    .unwrap_or_default();
                monitor.send_if_modified(|m| {
                    if *m == addr {
                        return false;
                    }
                    tracing::info!(monitor = %addr, "the monitor's address changed");
                    *m = addr;
                    true
                });
            }
        }
        tokio::time::sleep(poll).await;
    }
}

type MapStream = Pin<Box<dyn Stream<Item = Result<pb::ClusterMapReply, Status>> + Send>>;

#[tonic::async_trait]
impl RoutingService for Routing {
    async fn get_cluster_map(
        &self,
        req: Request<pb::GetClusterMapRequest>,
    ) -> Result<Response<pb::ClusterMapReply>, Status> {
        let mut rx = self.current.clone();
        if let Some(v) = req.into_inner().newer_than {
            let _ = tokio::time::timeout(Duration::from_secs(3), rx.wait_for(|c| c.0 > v)).await;
        }
        let (version, map) = rx.borrow().clone();
        if version == 0 {
            return Err(Status::unavailable(
                "no cluster map has been published yet; retry shortly",
            ));
        }
        metrics::counter!("dinomo_routing_map_requests_total").increment(1);
        Ok(Response::new(reply((version, map), &self.monitor)))
    }

    type WatchClusterMapStream = MapStream;

    async fn watch_cluster_map(
        &self,
        req: Request<pb::WatchClusterMapRequest>,
    ) -> Result<Response<Self::WatchClusterMapStream>, Status> {
        let mut known = req.into_inner().known_version;
        let mut rx = self.current.clone();
        let monitor = self.monitor.clone();
        let stream = async_stream(move |tx| async move {
            loop {
                let next = { rx.borrow_and_update().clone() };
                if next.0 > known {
                    known = next.0;
                    if tx.send(Ok(reply(next, &monitor))).await.is_err() {
                        return;
                    }
                }
                // Wait for a newer map, or for the client to go away: a dropped watcher is
                // otherwise noticed only at the next send, and in a stable cluster there may
                // never be one, so tasks of departed watchers would pile up.
                tokio::select! {
                    changed = rx.changed() => if changed.is_err() { return },
                    () = tx.closed() => return,
                }
            }
        });
        Ok(Response::new(stream))
    }
}

/// A stream fed by a task through a channel.
fn async_stream<F, Fut>(f: F) -> MapStream
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<pb::ClusterMapReply, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tokio::spawn(f(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// Serves RoutingService on `listener` until `shutdown` completes.
pub async fn run(
    listener: tokio::net::TcpListener,
    dpm: String,
    poll: Duration,
    security: dinomo_security::Security,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let (tx, rx) = watch::channel((0u64, Vec::new()));
    let (monitor_tx, monitor) = watch::channel(String::new());
    let mut server = security.server_builder()?;
    let poller = tokio::spawn(poll_dpm(security.clone(), dpm, poll, tx, monitor_tx));
    let addr: SocketAddr = listener.local_addr()?;
    security.warn_if_insecure("routing-node", addr);
    tracing::info!(%addr, "routing-node serving");
    // Ready for a probe once it holds a cluster map to hand out.
    let (health, health_service) = dinomo_node_common::health::Health::new().await;
    let shutdown = health.on_shutdown(shutdown);
    let probed = rx.clone();
    let health_task = health.follow("routing-node", move || probed.borrow().0 > 0);
    let r = server
        .add_service(health_service)
        .add_service(RoutingServiceServer::new(Routing {
            current: rx,
            monitor,
        }))
        .serve_with_incoming_shutdown(dinomo_proto::nodelay_incoming(listener), shutdown)
        .await;
    poller.abort();
    health_task.abort();
    Ok(r?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    /// A watcher that goes away must not leave its task (and its clone of the map) behind
    /// until the next map is published: in a stable cluster that is never, and clients that
    /// re-watch on every reconnect would pile tasks up without bound.
    #[tokio::test]
    async fn a_dropped_watch_ends_its_task_without_waiting_for_a_new_map() {
        let (tx, rx) = watch::channel((1u64, vec![1u8]));
        let routing = Routing {
            current: rx,
            monitor: watch::channel(String::new()).1,
        };
        let mut stream = routing
            .watch_cluster_map(Request::new(pb::WatchClusterMapRequest {
                known_version: 0,
            }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(stream.next().await.unwrap().unwrap().version, 1);
        assert_eq!(tx.receiver_count(), 2, "the service's and the watch task's");
        drop(stream);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(2);
        while tx.receiver_count() > 1 && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            tx.receiver_count(),
            1,
            "the watch task outlived its client while no new map was published"
        );
    }

    /// Clients learn the monitor's address with the map (issue 12: no client reported
    /// latencies unless told where the monitor was, so the policy saw a loaded cluster as idle).
    #[tokio::test]
    async fn the_map_comes_with_the_monitor_address() {
        let (_tx, rx) = watch::channel((3u64, vec![1u8]));
        let (monitor_tx, monitor) = watch::channel(String::new());
        let routing = Routing {
            current: rx,
            monitor,
        };
        let get = || async {
            routing
                .get_cluster_map(Request::new(pb::GetClusterMapRequest { newer_than: None }))
                .await
                .unwrap()
                .into_inner()
        };
        assert_eq!(get().await.monitor, "", "none published yet");
        monitor_tx.send_replace("10.0.0.9:7600".into());
        let r = get().await;
        assert_eq!((r.version, r.monitor.as_str()), (3, "10.0.0.9:7600"));
        let mut stream = routing
            .watch_cluster_map(Request::new(pb::WatchClusterMapRequest {
                known_version: 0,
            }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            stream.next().await.unwrap().unwrap().monitor,
            "10.0.0.9:7600"
        );
    }
}
