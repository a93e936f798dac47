//! The KV wire transport against fake KV nodes that speak `dinomo_proto::wire` by hand: many
//! operations share one connection and each gets its own answer; a failure before the node's
//! hello is "never sent" (a write is retried), after it a write's outcome is unknown.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use dinomo_client::{ClientError, KvTransport};
use dinomo_proto::kv as pb;
use dinomo_proto::wire;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::pipeline::read_all;
use crate::write_outcome::client_over;

/// What a fake KN does with a connection after reading the preface.
#[derive(Clone, Copy)]
enum Behaviour {
    /// Says hello, answers each Get with its key as the value, after a delay that depends on
    /// the request id (so answers overtake each other); fails its first connection after
    /// `fail_first_after` requests.
    Echo { fail_first_after: usize },
    /// Says hello, reads one request, and hangs up without answering.
    HangUpAfterOneRequest,
    /// Refuses the caller in its hello.
    Refuse,
    /// Says hello, reads requests, and never answers them.
    Silent,
}

/// Starts a fake KN; returns its address and how many connections it accepted.
async fn fake_kn(behaviour: Behaviour) -> (SocketAddr, Arc<AtomicUsize>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    let accepted = Arc::new(AtomicUsize::new(0));
    let count = accepted.clone();
    tokio::spawn(async move {
        loop {
            let (sock, _) = l.accept().await.unwrap();
            let n = count.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(serve(sock, behaviour, n == 0));
        }
    });
    (addr, accepted)
}

async fn send(sock: &tokio::sync::Mutex<tokio::net::tcp::OwnedWriteHalf>, r: &pb::KvResponse) {
    let mut out = BytesMut::new();
    wire::encode(r, &mut out);
    let _ = sock.lock().await.write_all(&out).await;
}

async fn serve(sock: TcpStream, behaviour: Behaviour, first: bool) {
    let (mut rd, wr) = sock.into_split();
    let wr = Arc::new(tokio::sync::Mutex::new(wr));
    let mut preface = [0u8; wire::PREFACE.len()];
    rd.read_exact(&mut preface).await.unwrap();
    assert_eq!(preface, wire::PREFACE);
    if let Behaviour::Refuse = behaviour {
        let no = pb::KvResponse {
            code: tonic::Code::PermissionDenied as i32,
            message: "the fake KN refuses everyone".into(),
            ..Default::default()
        };
        send(&wr, &no).await;
        return;
    }
    send(&wr, &pb::KvResponse::default()).await;
    let mut buf = BytesMut::new();
    let mut seen = 0;
    loop {
        let req = loop {
            if let Some(r) = wire::decode::<pb::KvRequest>(&mut buf).unwrap() {
                break r;
            }
            if rd.read_buf(&mut buf).await.unwrap_or(0) == 0 {
                return;
            }
        };
        seen += 1;
        match behaviour {
            Behaviour::HangUpAfterOneRequest => return,
            Behaviour::Silent => continue,
            Behaviour::Echo { fail_first_after } if first && seen > fail_first_after => return,
            _ => {}
        }
        let wr = wr.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_micros(req.id * 7919 % 2000)).await;
            let value = match req.op {
                Some(pb::kv_request::Op::Get(g)) => g.key,
                _ => Bytes::new(),
            };
            let r = pb::KvResponse {
                id: req.id,
                value,
                ..Default::default()
            };
            send(&wr, &r).await;
        });
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_operations_share_one_connection_and_get_their_own_answers() {
    let (kn, accepted) = fake_kn(Behaviour::Echo {
        fail_first_after: usize::MAX,
    })
    .await;
    let client = client_over(kn, KvTransport::Wire).await;
    read_all(&client, 300).await;
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "one connection carried them all"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_on_a_failed_connection_are_retried_on_a_new_one() {
    let (kn, accepted) = fake_kn(Behaviour::Echo {
        fail_first_after: 10,
    })
    .await;
    let client = client_over(kn, KvTransport::Wire).await;
    read_all(&client, 100).await;
    assert!(
        accepted.load(Ordering::SeqCst) >= 2,
        "the failed connection was replaced"
    );
}

#[tokio::test]
async fn an_insert_the_kn_received_over_the_wire_is_not_retried() {
    let (kn, accepted) = fake_kn(Behaviour::HangUpAfterOneRequest).await;
    let client = client_over(kn, KvTransport::Wire).await;
    match client.insert("k", "v").await {
        Err(ClientError::OutcomeUnknown(_)) => {}
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    assert_eq!(
        accepted.load(Ordering::SeqCst),
        1,
        "the write was not sent again"
    );
}

/// A caller the KN's access table refuses (PERMISSION_DENIED in the hello) gets a final
/// PermissionDenied at once: nothing was sent, and retrying with the same identity cannot help
/// (it used to retry until the deadline and report DeadlineExceeded).
#[tokio::test]
async fn an_insert_refused_in_the_hello_fails_at_once_with_permission_denied() {
    let (kn, accepted) = fake_kn(Behaviour::Refuse).await;
    let client = client_over(kn, KvTransport::Wire).await;
    match client.insert("k", "v").await {
        Err(ClientError::PermissionDenied(m)) => {
            assert!(m.contains("refuses everyone"), "the KN's reason: {m}")
        }
        other => panic!("expected PermissionDenied, got {other:?}"),
    }
    assert_eq!(accepted.load(Ordering::SeqCst), 1, "not retried");
}

/// An operation the KN never answers fails once it has waited the RPC timeout (2 s here), not
/// before, and not much later: the stream's sweep (a quarter of the timeout apart) fails it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_without_an_answer_fails_after_the_rpc_timeout() {
    let (kn, _) = fake_kn(Behaviour::Silent).await;
    let client = client_over(kn, KvTransport::Wire).await;
    let begun = std::time::Instant::now();
    let (read, write) = tokio::join!(client.get("k"), client.insert("k2", "v"));
    let waited = begun.elapsed();
    match read {
        Err(ClientError::DeadlineExceeded { last, .. }) => {
            assert!(last.contains("no answer"), "why: {last}")
        }
        other => panic!("expected DeadlineExceeded, got {other:?}"),
    }
    match write {
        Err(ClientError::OutcomeUnknown(m)) => assert!(m.contains("no answer"), "why: {m}"),
        other => panic!("expected OutcomeUnknown, got {other:?}"),
    }
    assert!(
        waited >= Duration::from_secs(2),
        "failed before the 2 s RPC timeout: {waited:?}"
    );
    assert!(
        waited < Duration::from_millis(3500),
        "failed long after the 2 s RPC timeout: {waited:?}"
    );
}

#[tokio::test]
async fn an_insert_refused_at_connect_is_retried_until_the_deadline() {
    let closed = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    let client = client_over(closed, KvTransport::Wire).await;
    match client.insert("k", "v").await {
        Err(ClientError::DeadlineExceeded { attempts, .. }) => {
            assert!(attempts > 1, "a never-sent write is retried: {attempts}")
        }
        other => panic!("expected DeadlineExceeded after retries, got {other:?}"),
    }
}
