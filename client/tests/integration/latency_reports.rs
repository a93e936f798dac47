//! Latency reports go, by default, to the monitor the routing node names with the map, and
//! nowhere when switched off (issue 12: no client reported unless told where the monitor was,
//! so the monitor took a loaded cluster for an idle one and removed a KN).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::fakes::{one_kn_map, EchoKn, FakeRouting};
use bytes::Bytes;
use dinomo_client::{Client, ClientConfig, KvTransport};
use dinomo_placement::{ClusterMap, KnInfo};
use dinomo_proto::monitor as mpb;
use dinomo_proto::monitor::monitor_service_server::{MonitorService, MonitorServiceServer};
use tonic::{Request, Response, Status};

/// A monitor that keeps the latency reports it receives.
#[derive(Clone, Default)]
struct Reports(Arc<Mutex<Vec<mpb::LatencyReport>>>);

impl Reports {
    fn count(&self) -> u64 {
        self.0.lock().unwrap().iter().map(|r| r.count).sum()
    }
}

#[tonic::async_trait]
impl MonitorService for Reports {
    async fn report_latency(
        &self,
        r: Request<mpb::LatencyReport>,
    ) -> Result<Response<mpb::LatencyReply>, Status> {
        self.0.lock().unwrap().push(r.into_inner());
        Ok(Response::new(mpb::LatencyReply {
            report_every_ms: 100,
        }))
    }
    async fn status(
        &self,
        _: Request<mpb::StatusRequest>,
    ) -> Result<Response<mpb::StatusReply>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
    async fn add_kn(
        &self,
        _: Request<mpb::AddKnRequest>,
    ) -> Result<Response<mpb::ActionReply>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
    async fn remove_kn(
        &self,
        _: Request<mpb::KnRequest>,
    ) -> Result<Response<mpb::ActionReply>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
    async fn fail_kn(
        &self,
        _: Request<mpb::KnRequest>,
    ) -> Result<Response<mpb::ActionReply>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
    async fn set_policy(
        &self,
        _: Request<mpb::PolicyRequest>,
    ) -> Result<Response<mpb::PolicyReply>, Status> {
        Err(Status::unimplemented("not in this test"))
    }
}

async fn listener() -> (tokio::net::TcpListener, String) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    (l, addr)
}

/// A fake monitor serving on a fresh loopback port: what it received, and its address.
async fn fake_monitor() -> (Reports, String) {
    let reports = Reports::default();
    let (ml, monitor) = listener().await;
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(MonitorServiceServer::new(reports.clone()))
            .serve_with_incoming(dinomo_proto::nodelay_incoming(ml)),
    );
    (reports, monitor)
}

/// A fake monitor, and a client with `report_latency` through a routing node naming it.
/// Every operation of the client ends in a deadline (its KN refuses connections), which is
/// recorded and reported like any other outcome.
async fn setup(report_latency: bool) -> (Client, Reports, String) {
    let (reports, monitor) = fake_monitor().await;
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let map = ClusterMap::new(
        vec![KnInfo {
            id: 1,
            endpoint: closed.to_string(),
        }],
        16,
        1,
    )
    .unwrap();
    // Its only KN refuses connections.
    let routing = FakeRouting::fixed(map.encode())
        .with_monitor(&monitor)
        .serve()
        .await;
    let mut cfg = ClientConfig::new(&[routing]);
    cfg.deadline = Duration::from_millis(100);
    cfg.report_every = Duration::from_millis(100);
    cfg.report_latency = report_latency;
    (Client::connect_with(cfg).await.unwrap(), reports, monitor)
}

#[tokio::test]
async fn a_default_client_reports_to_the_monitor_the_routing_node_names() {
    let (client, reports, monitor) = setup(true).await;
    assert_eq!(client.monitor().as_deref(), Some(monitor.as_str()));
    assert!(client.get("k").await.is_err());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while reports.count() == 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(reports.count(), 1, "the one operation, reported once");
}

#[tokio::test]
async fn a_client_that_opted_out_reports_nothing() {
    let (client, reports, _) = setup(false).await;
    assert!(client.get("k").await.is_err());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(reports.count(), 0);
}

/// A client that connected before its routing node knew of the monitor (a cluster starting,
/// its clients with it) and whose operations all succeed, so that it never fetches the map
/// again, still finds the monitor: with latencies to report and nowhere to send them, it asks
/// the routing nodes again. (It never did: the shm failover test's monitor saw no report for
/// 60 s and replicated no hot key.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_finds_a_monitor_its_routing_node_named_after_it_connected() {
    let (reports, monitor) = fake_monitor().await;
    let (kn, _) = EchoKn::serve(usize::MAX).await;
    let routing = FakeRouting::fixed(one_kn_map(kn))
        .with_monitor_learned_late(&monitor)
        .serve()
        .await;
    let mut cfg = ClientConfig::new(&[routing]);
    cfg.transport = KvTransport::Grpc; // the fake KN serves gRPC only
    cfg.report_every = Duration::from_millis(100);
    let client = Client::connect_with(cfg).await.unwrap();
    assert_eq!(client.monitor(), None, "no monitor named at connect");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while reports.count() == 0 && tokio::time::Instant::now() < deadline {
        assert_eq!(client.get("k").await, Ok(Some(Bytes::from("k"))));
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(reports.count() > 0, "no latency reached the monitor");
    assert_eq!(client.monitor().as_deref(), Some(monitor.as_str()));
}

/// A cluster without a monitor: a client with latencies asks its routing nodes for one less
/// and less often (at most MAX_MONITOR_ASK_GAP apart), not every interval forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_asks_for_a_monitor_less_often_while_none_is_named() {
    let (kn, _) = EchoKn::serve(usize::MAX).await;
    let routing = FakeRouting::fixed(one_kn_map(kn));
    let calls = routing.calls();
    let routing = routing.serve().await;
    let mut cfg = ClientConfig::new(&[routing]);
    cfg.transport = KvTransport::Grpc; // the fake KN serves gRPC only
    cfg.report_every = Duration::from_millis(50);
    let client = Client::connect_with(cfg).await.unwrap();
    let until = tokio::time::Instant::now() + Duration::from_millis(2000);
    while tokio::time::Instant::now() < until {
        assert_eq!(client.get("k").await, Ok(Some(Bytes::from("k"))));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // 40 intervals; asked after 50, 100, 200, 400, 800 ms gaps: 5 or 6 asks and the connect.
    let n = calls.load(std::sync::atomic::Ordering::SeqCst);
    assert!((2..=8).contains(&n), "{n} map fetches in 2 s");
}
