//! The tcp NIC's hello: a wrong key gets one "denied" byte and a closed connection, is
//! counted, and is answered only after a delay that doubles with its IP's refusals in a row
//! (from 100 ms); a correct hello is answered at once, binds the connection and resets the
//! count.

use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dinomo_fabric::grants::{GrantTable, WindowRange};
use dinomo_fabric::tcp::{encode_hello, NicOptions, TcpFabric, TcpNic, HELLO_DENIED};
use dinomo_fabric::{DurabilityRequest, FabricError, FabricExt, PmRegion};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LEN: u64 = 1 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_hello_is_denied_closed_counted_and_tarpitted() {
    let dir = tempfile::tempdir().unwrap();
    let pool = dir.path().join("pool");
    let region = Arc::new(PmRegion::create(&pool, LEN, DurabilityRequest::Auto).unwrap());
    let grants = Arc::new(GrantTable::create(&GrantTable::path_for(&pool), 4).unwrap());
    let base = Duration::from_millis(100);
    let nic = TcpNic::start_with(
        "127.0.0.1:0".parse().unwrap(),
        region,
        grants.clone(),
        NicOptions {
            hello_delay_base: base,
            ..NicOptions::default()
        },
    )
    .await
    .unwrap();
    let key = grants
        .grant_with_window(&[WindowRange::write(4096, 4096)])
        .unwrap();
    let mut wrong = key;
    wrong.secret[15] ^= 0x80;

    // A first correct hello is not delayed.
    let started = Instant::now();
    let f = TcpFabric::connect(nic.local_addr(), key).await.unwrap();
    f.write(4096, Bytes::from_static(b"ok")).await.unwrap();
    assert!(started.elapsed() < base, "no delay before any refusal");

    // A wrong one: one byte, then the connection ends.
    let started = Instant::now();
    let mut s = TcpStream::connect(nic.local_addr()).await.unwrap();
    s.write_all(&encode_hello(wrong)).await.unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
        .await
        .expect("the NIC closes the connection after a wrong hello");
    assert_eq!(got, vec![HELLO_DENIED], "exactly one denied byte");
    assert!(
        started.elapsed() >= base,
        "a wrong hello waits for its answer"
    );
    assert_eq!(nic.denied(), 1);

    // A right hello from the same IP (another KN of the host) is not slowed down, and resets
    // the count.
    let started = Instant::now();
    let f2 = TcpFabric::connect(nic.local_addr(), key).await.unwrap();
    let waited = started.elapsed();
    assert!(waited < base, "a right hello waited {waited:?}");
    f2.read(0, 8).await.unwrap();

    // Wrong hellos in a row wait longer and longer.
    let started = Instant::now();
    let r = TcpFabric::connect(nic.local_addr(), wrong).await;
    assert!(
        matches!(r, Err(FabricError::AccessDenied { slot }) if slot == key.slot),
        "{r:?}"
    );
    let first = started.elapsed();
    assert!(
        first >= base && first < 2 * base,
        "after a success: {first:?}"
    );
    let started = Instant::now();
    let _ = TcpFabric::connect(nic.local_addr(), wrong).await;
    assert!(
        started.elapsed() >= 2 * base,
        "the delay doubles per refusal"
    );
    assert_eq!(nic.denied(), 3);
    f.write(4100, Bytes::from_static(b"still")).await.unwrap();
}
