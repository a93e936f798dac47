//! A map under which no KV node owns the key (between the removal of a cluster's last KN and
//! the start of its replacement) is a reason to fetch a newer map, not to retry the same one
//! until the deadline (the monitor test of a replaced last KN failed so in CI).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dinomo_client::{Client, ClientConfig, ClientError};
use dinomo_placement::{ClusterMap, KnInfo};
use dinomo_proto::routing as pb;
use dinomo_proto::routing::routing_service_server::{RoutingService, RoutingServiceServer};
use tonic::{Request, Response, Status};

/// Serves `first` to the first request, `later` to every other one.
struct Changing {
    first: Vec<u8>,
    later: Vec<u8>,
    calls: Arc<AtomicU32>,
}

type MapStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<pb::ClusterMapReply, Status>> + Send>>;

#[tonic::async_trait]
impl RoutingService for Changing {
    async fn get_cluster_map(
        &self,
        _: Request<pb::GetClusterMapRequest>,
    ) -> Result<Response<pb::ClusterMapReply>, Status> {
        let n = self.calls.fetch_add(1, Ordering::SeqCst);
        let map = if n == 0 { &self.first } else { &self.later };
        Ok(Response::new(pb::ClusterMapReply {
            version: 0,
            map: map.clone(),
            monitor: String::new(),
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

#[tokio::test]
async fn a_map_where_no_kn_owns_the_key_is_refreshed() {
    let mut empty = ClusterMap::new(Vec::new(), 16, 1).unwrap();
    empty.version = 2;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let mut replaced = ClusterMap::new(
        vec![KnInfo {
            id: 2,
            endpoint: closed.to_string(),
        }],
        16,
        1,
    )
    .unwrap();
    replaced.version = 3;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let routing = listener.local_addr().unwrap().to_string();
    let calls = Arc::new(AtomicU32::new(0));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(RoutingServiceServer::new(Changing {
                first: empty.encode(),
                later: replaced.encode(),
                calls: calls.clone(),
            }))
            .serve_with_incoming(dinomo_proto::nodelay_incoming(listener)),
    );
    let mut cfg = ClientConfig::new(&[routing]);
    cfg.deadline = Duration::from_millis(500);
    cfg.report_latency = false;
    let client = Client::connect_with(cfg).await.unwrap();
    assert_eq!(client.map().version, 2);
    match client.get("k").await {
        Err(ClientError::DeadlineExceeded { last, .. }) => assert!(
            !last.contains("no KV node owns"),
            "the client kept the map without an owner: {last}"
        ),
        other => panic!("expected DeadlineExceeded (the new owner is down), got {other:?}"),
    }
    assert_eq!(client.map().version, 3, "the newer map was not fetched");
}
