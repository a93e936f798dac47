//! A write that fails may be retried only if it provably never left the client: a refused
//! connection is retried (until the deadline), a connection that dies after the KN received
//! the request ends in `OutcomeUnknown`, never in a silent retry.

use std::pin::Pin;
use std::time::Duration;

use crate::fakes::FakeRouting;
use dinomo_client::{Client, ClientConfig, ClientError, KvTransport};
use dinomo_placement::{ClusterMap, KnInfo};
use dinomo_proto::kv;
use dinomo_proto::kv::kv_service_server::{KvService, KvServiceServer};
use tokio::io::AsyncReadExt;
use tonic::{Request, Response, Status};

/// A client whose only KN is at `kn`, through a fake routing node, on the gRPC transport (the
/// fake KNs here speak gRPC; wire.rs has the same cases for the KV wire).
async fn client_of(kn: std::net::SocketAddr) -> Client {
    client_over(kn, KvTransport::Grpc).await
}

/// A client whose only KN is at `kn`, through a fake routing node, on `transport`.
pub(crate) async fn client_over(kn: std::net::SocketAddr, transport: KvTransport) -> Client {
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
    cfg.deadline = Duration::from_millis(500);
    cfg.rpc_timeout = Duration::from_secs(2);
    cfg.report_latency = false;
    cfg.transport = transport;
    Client::connect_with(cfg).await.unwrap()
}

#[tokio::test]
async fn an_insert_refused_at_connect_is_retried_until_the_deadline() {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let client = client_of(closed).await;
    match client.insert("k", "v").await {
        Err(ClientError::DeadlineExceeded { attempts, .. }) => {
            assert!(attempts > 1, "a never-sent write is retried: {attempts}")
        }
        other => panic!("expected DeadlineExceeded after retries, got {other:?}"),
    }
}

#[tokio::test]
async fn an_insert_the_kn_received_is_not_retried() {
    // A "KN" that reads the request and hangs up without answering.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let kn = l.local_addr().unwrap();
    let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        loop {
            let (mut sock, _) = l.accept().await.unwrap();
            count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            tokio::spawn(async move {
                let mut got = Vec::new();
                let mut buf = [0u8; 4096];
                let probe = b"outcome-probe-key";
                while !got.windows(probe.len()).any(|w| w == probe) {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => got.extend_from_slice(&buf[..n]),
                    }
                }
            });
        }
    });
    let client = client_of(kn).await;
    match client.insert("outcome-probe-key", "v").await {
        Err(ClientError::OutcomeUnknown(_)) => {}
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    assert_eq!(
        accepted.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the write was not sent again"
    );
}

/// A "KN" behind a proxy that applies every request and then loses the answer, reporting it
/// the way Envoy does. The words "connect" and "connection" in that message say nothing about
/// whether the request was sent (here it was, and applied).
const PROXY_MESSAGE: &str = "upstream connect error or disconnect/reset before headers. \
                             reset reason: connection termination";

fn lost() -> Status {
    Status::unavailable(PROXY_MESSAGE)
}

type KvStream = Pin<Box<dyn futures::Stream<Item = Result<kv::KvResponse, Status>> + Send>>;

/// A KvService whose every call fails with `status()`, counting the calls that carry
/// operations (Batch and the SDK's Pipeline).
struct AlwaysFails {
    status: fn() -> Status,
    calls: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl AlwaysFails {
    fn counted(&self) -> Status {
        self.calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        (self.status)()
    }
}

#[tonic::async_trait]
impl KvService for AlwaysFails {
    async fn get(&self, _: Request<kv::GetRequest>) -> Result<Response<kv::GetResponse>, Status> {
        Err((self.status)())
    }
    async fn put(&self, _: Request<kv::PutRequest>) -> Result<Response<kv::PutResponse>, Status> {
        Err((self.status)())
    }
    async fn delete(
        &self,
        _: Request<kv::DeleteRequest>,
    ) -> Result<Response<kv::DeleteResponse>, Status> {
        Err((self.status)())
    }
    async fn batch(
        &self,
        _: Request<kv::BatchRequest>,
    ) -> Result<Response<kv::BatchResponse>, Status> {
        Err(self.counted())
    }
    type PipelineStream = KvStream;
    async fn pipeline(
        &self,
        _: Request<tonic::Streaming<kv::KvRequest>>,
    ) -> Result<Response<KvStream>, Status> {
        Err(self.counted())
    }
    async fn stats(
        &self,
        _: Request<kv::KnStatsRequest>,
    ) -> Result<Response<kv::KnStatsResponse>, Status> {
        Err((self.status)())
    }
    async fn prepare_map(
        &self,
        _: Request<kv::MapRequest>,
    ) -> Result<Response<kv::MapReply>, Status> {
        Err((self.status)())
    }
    async fn commit_map(
        &self,
        _: Request<kv::MapRequest>,
    ) -> Result<Response<kv::MapReply>, Status> {
        Err((self.status)())
    }
}

/// Serves `kv` on a new port; its address.
async fn serve_kn(kv: AlwaysFails) -> std::net::SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let kn = l.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(KvServiceServer::new(kv))
            .serve_with_incoming(dinomo_proto::nodelay_incoming(l)),
    );
    kn
}

/// Finding 1 of issue 10: a status that merely mentions "connect" made the old
/// Debug-substring check call an applied insert "never sent" and retry it.
#[tokio::test]
async fn an_insert_lost_behind_a_proxy_saying_connect_is_not_retried() {
    let applied = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let kn = serve_kn(AlwaysFails {
        status: lost,
        calls: applied.clone(),
    })
    .await;
    let client = client_of(kn).await;
    let r = client.insert("k", "v").await;
    let n = applied.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        matches!(r, Err(ClientError::OutcomeUnknown(_))) && n == 1,
        "expected OutcomeUnknown after one attempt; got {r:?} after {n} attempts"
    );
}

/// What the access layer answers a certificate of the wrong role.
fn refused() -> Status {
    Status::permission_denied(
        "/dinomo.kv.KvService/Pipeline needs role client; this caller is monitor",
    )
}

/// The access layer refuses before any handler runs, so a refused write was not applied: it
/// fails at once with PermissionDenied (it used to be OutcomeUnknown, which tells the caller
/// to read the key back to find out; the Python SDK's author found it).
#[tokio::test]
async fn a_write_the_access_layer_refuses_is_permission_denied_not_unknown() {
    let calls = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let kn = serve_kn(AlwaysFails {
        status: refused,
        calls: calls.clone(),
    })
    .await;
    let client = client_of(kn).await;
    match client.insert("k", "v").await {
        Err(ClientError::PermissionDenied(m)) => assert!(m.contains("needs role client"), "{m}"),
        other => panic!("expected PermissionDenied, got {other:?}"),
    }
    match client.get("k").await {
        Err(ClientError::PermissionDenied(_)) => {}
        other => panic!("a refused read: expected PermissionDenied, got {other:?}"),
    }
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        2,
        "not retried"
    );
}
