//! Fakes for the tests of this suite: a routing node that serves cluster maps (and a
//! monitor's address) from GetClusterMap, and does not serve WatchClusterMap (the client
//! falls back to fetching); a KV node that echoes keys ([`EchoKn`]).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dinomo_placement::{ClusterMap, KnInfo};
use dinomo_proto::kv;
use dinomo_proto::kv::kv_service_server::{KvService, KvServiceServer};
use dinomo_proto::routing as pb;
use dinomo_proto::routing::routing_service_server::{RoutingService, RoutingServiceServer};
use futures::StreamExt;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

/// Serves `first` to the first GetClusterMap and `later` to every other one.
pub(crate) struct FakeRouting {
    first: Vec<u8>,
    later: Vec<u8>,
    /// The reply's version field (the encoded maps carry their own).
    version: u64,
    monitor: String,
    /// The first call (0-based) whose answer names `monitor`; earlier ones name none.
    monitor_from_call: u32,
    /// GetClusterMap calls answered so far.
    calls: Arc<AtomicU32>,
}

impl FakeRouting {
    /// Always the same map (version 1), naming no monitor.
    pub(crate) fn fixed(map: Vec<u8>) -> Self {
        FakeRouting {
            first: map.clone(),
            later: map,
            version: 1,
            monitor: String::new(),
            monitor_from_call: 0,
            calls: Arc::new(AtomicU32::new(0)),
        }
    }

    /// `first` once, then `later` (version 0).
    pub(crate) fn changing(first: Vec<u8>, later: Vec<u8>) -> Self {
        FakeRouting {
            first,
            later,
            version: 0,
            monitor: String::new(),
            monitor_from_call: 0,
            calls: Arc::new(AtomicU32::new(0)),
        }
    }

    /// Names `monitor` with the map.
    pub(crate) fn with_monitor(mut self, monitor: &str) -> Self {
        self.monitor = monitor.to_string();
        self
    }

    /// Names `monitor` only from the second GetClusterMap on: a routing node that learned of
    /// the monitor after the client connected (both started together).
    pub(crate) fn with_monitor_learned_late(mut self, monitor: &str) -> Self {
        self.monitor = monitor.to_string();
        self.monitor_from_call = 1;
        self
    }

    /// The count of GetClusterMap calls it answered (shared: read it after `serve`).
    pub(crate) fn calls(&self) -> Arc<AtomicU32> {
        self.calls.clone()
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
            monitor: if n >= self.monitor_from_call {
                self.monitor.clone()
            } else {
                String::new()
            },
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

/// A KV node that answers a Get with its key as the value, each answer after a delay that
/// depends on the request id (so answers overtake each other). Its first stream fails after
/// `fail_first_after` requests, without answering the rest (`usize::MAX`: never).
pub(crate) struct EchoKn {
    streams: Arc<AtomicUsize>,
    fail_first_after: usize,
}

type KvStream = Pin<Box<dyn futures::Stream<Item = Result<kv::KvResponse, Status>> + Send>>;

fn unimplemented() -> Status {
    Status::unimplemented("not in this test")
}

#[tonic::async_trait]
impl KvService for EchoKn {
    async fn get(&self, _: Request<kv::GetRequest>) -> Result<Response<kv::GetResponse>, Status> {
        Err(unimplemented())
    }
    async fn put(&self, _: Request<kv::PutRequest>) -> Result<Response<kv::PutResponse>, Status> {
        Err(unimplemented())
    }
    async fn delete(
        &self,
        _: Request<kv::DeleteRequest>,
    ) -> Result<Response<kv::DeleteResponse>, Status> {
        Err(unimplemented())
    }
    async fn batch(
        &self,
        _: Request<kv::BatchRequest>,
    ) -> Result<Response<kv::BatchResponse>, Status> {
        Err(unimplemented())
    }
    type PipelineStream = KvStream;
    async fn pipeline(
        &self,
        r: Request<tonic::Streaming<kv::KvRequest>>,
    ) -> Result<Response<KvStream>, Status> {
        let first = self.streams.fetch_add(1, Ordering::SeqCst) == 0;
        let fail_after = if first {
            self.fail_first_after
        } else {
            usize::MAX
        };
        let mut incoming = r.into_inner();
        let (tx, rx) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut seen = 0;
            while let Some(Ok(req)) = incoming.next().await {
                seen += 1;
                if seen > fail_after {
                    let _ = tx.send(Err(Status::unavailable("the fake KN drops the stream")));
                    return;
                }
                let tx = tx.clone();
                tokio::spawn(async move {
                    tokio::time::sleep(Duration::from_micros(req.id * 7919 % 2000)).await;
                    let value = match req.op {
                        Some(kv::kv_request::Op::Get(g)) => g.key,
                        _ => Bytes::new(),
                    };
                    let _ = tx.send(Ok(kv::KvResponse {
                        id: req.id,
                        code: 0,
                        message: String::new(),
                        value,
                        map_version: 0,
                    }));
                });
            }
        });
        Ok(Response::new(Box::pin(
            tokio_stream::wrappers::UnboundedReceiverStream::new(rx),
        )))
    }
    async fn stats(
        &self,
        _: Request<kv::KnStatsRequest>,
    ) -> Result<Response<kv::KnStatsResponse>, Status> {
        Err(unimplemented())
    }
    async fn prepare_map(
        &self,
        _: Request<kv::MapRequest>,
    ) -> Result<Response<kv::MapReply>, Status> {
        Err(unimplemented())
    }
    async fn commit_map(
        &self,
        _: Request<kv::MapRequest>,
    ) -> Result<Response<kv::MapReply>, Status> {
        Err(unimplemented())
    }
}

impl EchoKn {
    /// Serves one on a fresh loopback port until the test's runtime ends: its address, and the
    /// count of streams it saw opened.
    pub(crate) async fn serve(fail_first_after: usize) -> (SocketAddr, Arc<AtomicUsize>) {
        let streams = Arc::new(AtomicUsize::new(0));
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let kn = l.local_addr().unwrap();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(KvServiceServer::new(EchoKn {
                    streams: streams.clone(),
                    fail_first_after,
                }))
                .serve_with_incoming(dinomo_proto::nodelay_incoming(l)),
        );
        (kn, streams)
    }
}

/// An encoded map (version 1) whose one KN, at `kn`, owns every key.
pub(crate) fn one_kn_map(kn: SocketAddr) -> Vec<u8> {
    ClusterMap::new(
        vec![KnInfo {
            id: 1,
            endpoint: kn.to_string(),
        }],
        16,
        1,
    )
    .unwrap()
    .encode()
}
