//! Many operations share one Pipeline stream per KV node (the gRPC transport; wire.rs has the
//! same for the KV wire): each gets its own answer whatever
//! order the node answers in, and a stream that fails is replaced by a new one on which the
//! reads are retried.

use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dinomo_client::{Client, ClientConfig, KvTransport};
use dinomo_placement::{ClusterMap, KnInfo};
use dinomo_proto::kv;
use dinomo_proto::kv::kv_service_server::{KvService, KvServiceServer};
use futures::StreamExt;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use crate::fakes::FakeRouting;

/// A KV node that answers a Get with its key as the value, each answer after a delay that
/// depends on the request id (so answers overtake each other). Its first stream fails after
/// `fail_first_after` requests, without answering the rest.
struct Echo {
    streams: Arc<AtomicUsize>,
    fail_first_after: usize,
}

type KvStream = Pin<Box<dyn futures::Stream<Item = Result<kv::KvResponse, Status>> + Send>>;

fn unimplemented() -> Status {
    Status::unimplemented("not in this test")
}

#[tonic::async_trait]
impl KvService for Echo {
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

/// A client of one fake KN (see [`Echo`]) and the count of streams the KN saw opened.
async fn setup(fail_first_after: usize) -> (Client, Arc<AtomicUsize>) {
    let streams = Arc::new(AtomicUsize::new(0));
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let kn = l.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(KvServiceServer::new(Echo {
                streams: streams.clone(),
                fail_first_after,
            }))
            .serve_with_incoming(dinomo_proto::nodelay_incoming(l)),
    );
    let map = ClusterMap::new(
        vec![KnInfo {
            id: 1,
            endpoint: kn.to_string(),
        }],
        16,
        1,
    )
    .unwrap();
    let routing = FakeRouting::fixed(map.encode()).serve().await;
    let mut cfg = ClientConfig::new(&[routing]);
    cfg.transport = KvTransport::Grpc; // the fake KN serves gRPC only
    cfg.deadline = Duration::from_secs(10);
    cfg.report_latency = false;
    (Client::connect_with(cfg).await.unwrap(), streams)
}

/// Reads of `n` distinct keys, all in flight at once from clones of one client.
pub(crate) async fn read_all(client: &Client, n: usize) {
    let reads = (0..n).map(|i| {
        let client = client.clone();
        tokio::spawn(async move {
            let key = format!("key-{i}");
            let got = client.get(key.clone()).await;
            assert_eq!(got, Ok(Some(Bytes::from(key))));
        })
    });
    for r in futures::future::join_all(reads).await {
        r.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_operations_share_one_stream_and_get_their_own_answers() {
    let (client, streams) = setup(usize::MAX).await;
    read_all(&client, 300).await;
    assert_eq!(
        streams.load(Ordering::SeqCst),
        1,
        "one stream carried them all"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_on_a_failed_stream_are_retried_on_a_new_one() {
    let (client, streams) = setup(10).await;
    read_all(&client, 100).await;
    assert!(
        streams.load(Ordering::SeqCst) >= 2,
        "the failed stream was replaced"
    );
}
