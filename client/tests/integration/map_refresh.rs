//! A map under which no KV node owns the key (between the removal of a cluster's last KN and
//! the start of its replacement) is a reason to fetch a newer map, not to retry the same one
//! until the deadline (the monitor test of a replaced last KN failed so in CI).

use std::time::Duration;

use crate::fakes::FakeRouting;
use dinomo_client::{Client, ClientConfig, ClientError};
use dinomo_placement::{ClusterMap, KnInfo};

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
    let routing = FakeRouting::changing(empty.encode(), replaced.encode())
        .serve()
        .await;
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
