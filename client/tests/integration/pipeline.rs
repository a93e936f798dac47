//! Many operations share one Pipeline stream per KV node (the gRPC transport; wire.rs has the
//! same for the KV wire): each gets its own answer whatever
//! order the node answers in, and a stream that fails is replaced by a new one on which the
//! reads are retried.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dinomo_client::{Client, ClientConfig, KvTransport};

use crate::fakes::{one_kn_map, EchoKn, FakeRouting};

/// A client of one fake KN (see [`EchoKn`]) and the count of streams the KN saw opened.
async fn setup(fail_first_after: usize) -> (Client, Arc<AtomicUsize>) {
    let (kn, streams) = EchoKn::serve(fail_first_after).await;
    let routing = FakeRouting::fixed(one_kn_map(kn)).serve().await;
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
