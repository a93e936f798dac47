//! A fake routing node for the tests of this suite: it serves cluster maps (and a monitor's
//! address) from GetClusterMap, and does not serve WatchClusterMap (the client falls back to
//! fetching).

use std::pin::Pin;
use std::sync::atomic::{AtomicU32, Ordering};

use dinomo_proto::routing as pb;
use dinomo_proto::routing::routing_service_server::{RoutingService, RoutingServiceServer};
use tonic::{Request, Response, Status};

/// Serves `first` to the first GetClusterMap and `later` to every other one.
pub(crate) struct FakeRouting {
    first: Vec<u8>,
    later: Vec<u8>,
    /// The reply's version field (the encoded maps carry their own).
    version: u64,
    monitor: String,
    /// GetClusterMap calls answered so far.
    calls: AtomicU32,
}

impl FakeRouting {
    /// Always the same map (version 1), naming no monitor.
    pub(crate) fn fixed(map: Vec<u8>) -> Self {
        FakeRouting {
            first: map.clone(),
            later: map,
            version: 1,
            monitor: String::new(),
            calls: AtomicU32::new(0),
        }
    }

    /// `first` once, then `later` (version 0).
    pub(crate) fn changing(first: Vec<u8>, later: Vec<u8>) -> Self {
        FakeRouting {
            first,
            later,
            version: 0,
            monitor: String::new(),
            calls: AtomicU32::new(0),
        }
    }

    /// Names `monitor` with the map.
    pub(crate) fn with_monitor(mut self, monitor: &str) -> Self {
        self.monitor = monitor.to_string();
        self
    }

    /// Serves on a fresh loopback port until the test's runtime ends; the address.
    pub(crate) async fn serve(self) -> String {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(RoutingServiceServer::new(self))
                .serve_with_incoming(dinomo_proto::nodelay_incoming(listener)),
        );
        addr
    }
}

type MapStream = Pin<Box<dyn futures::Stream<Item = Result<pb::ClusterMapReply, Status>> + Send>>;

#[tonic::async_trait]
impl RoutingService for FakeRouting {
    async fn get_cluster_map(
        &self,
        _: Request<pb::GetClusterMapRequest>,
    ) -> Result<Response<pb::ClusterMapReply>, Status> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        let map = if n == 0 { &self.first } else { &self.later };
        Ok(Response::new(pb::ClusterMapReply {
            version: self.version,
            map: map.clone(),
            monitor: self.monitor.clone(),
        }))
    }

    type WatchClusterMapStream = MapStream;

    async fn watch_cluster_map(
        &self,
        _: Request<pb::WatchClusterMapRequest>,
    ) -> Result<Response<MapStream>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}
