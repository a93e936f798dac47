//! The tcp NIC's hello: a wrong key gets one "denied" byte and a closed connection, is
//! counted, and delays that IP's next hello by at least the base delay (100 ms); a correct
//! hello binds the connection and resets the delay.

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
async fn a_wrong_hello_is_denied_closed_counted_and_slows_the_next() {
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
    let mut s = TcpStream::connect(nic.local_addr()).await.unwrap();
    s.write_all(&encode_hello(wrong)).await.unwrap();
    let mut got = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
        .await
        .expect("the NIC closes the connection after a wrong hello");
    assert_eq!(got, vec![HELLO_DENIED], "exactly one denied byte");
    assert_eq!(nic.denied(), 1);

    // The next hello from this IP is read only after the base delay (even a correct one),
    // and a correct one is still accepted.
    let started = Instant::now();
    let f2 = TcpFabric::connect(nic.local_addr(), key).await.unwrap();
    let waited = started.elapsed();
    assert!(
        waited >= base,
        "the next hello was answered after {waited:?}"
    );
    f2.read(0, 8).await.unwrap();

    // The success reset the delay; a wrong key through the client API is AccessDenied.
    let started = Instant::now();
    let r = TcpFabric::connect(nic.local_addr(), wrong).await;
    assert!(
        matches!(r, Err(FabricError::AccessDenied { slot }) if slot == key.slot),
        "{r:?}"
    );
    assert!(started.elapsed() < base, "a success resets the delay");
    assert_eq!(nic.denied(), 2);
    // Two refusals in a row now: the next hello waits twice the base... after the reset, one
    // refusal: the base again.
    let started = Instant::now();
    let _ = TcpFabric::connect(nic.local_addr(), wrong).await;
    assert!(started.elapsed() >= base);
    let started = Instant::now();
    let _ = TcpFabric::connect(nic.local_addr(), wrong).await;
    assert!(
        started.elapsed() >= 2 * base,
        "the delay doubles per refusal"
    );
    assert_eq!(nic.denied(), 4);
    // The connection bound before all this still works.
    f.write(4100, Bytes::from_static(b"still")).await.unwrap();
}
