//! The tcp NIC against hostile or broken peers, over raw sockets: every bad frame (sent after a
//! correct hello, so it reaches the frame decoder) closes its own connection without a response, without a panic and without the NIC allocating what the
//! frame declares; well-behaved connections (already open or new) keep working.
//!
//! A counting global allocator records the largest single allocation of the process, so "did
//! not allocate the declared size" is checked, not assumed. One test function only: cases run
//! one after another and nothing else allocates in parallel.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dinomo_fabric::grants::{GrantTable, WindowRange};
use dinomo_fabric::tcp::{encode_hello, encode_request, TcpFabric, TcpNic, HELLO_OK, MAX_FRAME};
use dinomo_fabric::{AccessKey, DurabilityRequest, FabricExt, Op, PmRegion};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

struct PeakAlloc;

static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only records sizes.
unsafe impl GlobalAlloc for PeakAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        PEAK.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        PEAK.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        PEAK.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: same contract as ours.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: same contract as ours.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOC: PeakAlloc = PeakAlloc;

const REGION: u64 = 8 << 20;
/// Far above what the NIC needs for these frames (socket buffers of 256 KiB, a first frame
/// buffer of at most 2 MiB), far below any size a hostile frame declares (64 MiB and up).
const ALLOC_BOUND: usize = 16 << 20;

/// A request body header: id, op count.
fn header(n: u16) -> Vec<u8> {
    let mut b = Vec::new();
    b.extend_from_slice(&7u64.to_le_bytes());
    b.extend_from_slice(&n.to_le_bytes());
    b
}

/// A connection past a correct hello.
async fn bound(nic: &TcpNic, key: AccessKey) -> TcpStream {
    let mut s = TcpStream::connect(nic.local_addr()).await.unwrap();
    s.write_all(&encode_hello(key)).await.unwrap();
    let mut answer = [0u8; 1];
    s.read_exact(&mut answer).await.unwrap();
    assert_eq!(answer[0], HELLO_OK);
    s
}

fn framed(body: &[u8]) -> Vec<u8> {
    let mut f = (body.len() as u32).to_le_bytes().to_vec();
    f.extend_from_slice(body);
    f
}

fn read_op(b: &mut Vec<u8>, len: u32) {
    b.push(1);
    b.extend_from_slice(&0u64.to_le_bytes());
    b.extend_from_slice(&len.to_le_bytes());
}

/// Sends `bytes` (then half-closes if `eof`) and expects the NIC to close the connection
/// without answering.
async fn expect_closed(nic: &TcpNic, key: AccessKey, name: &str, bytes: &[u8], eof: bool) {
    let mut s = bound(nic, key).await;
    // The NIC may close before it has read everything we send; that is fine.
    let _ = s.write_all(bytes).await;
    if eof {
        let _ = s.shutdown().await;
    }
    let mut got = Vec::new();
    let r = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut got))
        .await
        .unwrap_or_else(|_| panic!("{name}: the NIC kept the connection open"));
    // A reset (unread bytes at close) is as good as an orderly close.
    if r.is_ok() {
        assert!(
            got.is_empty(),
            "{name}: the NIC answered {} bytes instead of closing",
            got.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_frames_close_only_their_connection() {
    let dir = tempfile::tempdir().unwrap();
    let pool = dir.path().join("pool");
    let region = Arc::new(PmRegion::create(&pool, REGION, DurabilityRequest::Auto).unwrap());
    let grants = Arc::new(GrantTable::create(&GrantTable::path_for(&pool), 8).unwrap());
    let nic = TcpNic::start("127.0.0.1:0".parse().unwrap(), region, grants.clone())
        .await
        .unwrap();
    let key = grants
        .grant_with_window(&[WindowRange::write(0, REGION)])
        .unwrap();
    let good = TcpFabric::connect(nic.local_addr(), key).await.unwrap();
    good.write(64, Bytes::from_static(b"before")).await.unwrap();
    PEAK.store(0, Ordering::Relaxed);

    let mut cases: Vec<(&str, Vec<u8>, bool)> = Vec::new();
    // The op count is 16 bits on the wire: 65535 is the most a frame can declare, and
    // `ff ff ff ff` where the count starts is what a 2^32-1 count looks like.
    let mut b = header(u16::MAX);
    read_op(&mut b, 8);
    cases.push(("65535 ops declared, one sent", framed(&b), false));
    let mut b = header(0);
    b.truncate(b.len() - 2);
    b.extend_from_slice(&[0xff; 4]);
    cases.push(("2^32-1 ops declared", framed(&b), false));
    // A READ of 4 GiB - 1 (the most the u32 length holds), by a granted key.
    let mut b = header(1);
    read_op(&mut b, u32::MAX);
    cases.push(("READ of 4 GiB", framed(&b), false));
    // Two READs whose reply together exceeds the frame limit.
    let mut b = header(2);
    read_op(&mut b, (MAX_FRAME / 2) as u32);
    read_op(&mut b, (MAX_FRAME / 2) as u32);
    cases.push(("READs adding up to more than a frame", framed(&b), false));
    cases.push((
        "frame length 4 GiB - 1",
        u32::MAX.to_le_bytes().to_vec(),
        false,
    ));
    cases.push((
        "frame one byte over the limit",
        (MAX_FRAME as u32 + 1).to_le_bytes().to_vec(),
        false,
    ));
    let mut b = framed(&header(1));
    b[0] = 100; // announces 100 bytes, 10 follow, then end of stream
    cases.push(("truncated frame", b, true));
    cases.push(("two of four length bytes", vec![9, 0], true));
    cases.push((
        "an HTTP request",
        b"GET / HTTP/1.1\r\nHost: nic\r\n\r\n".to_vec(),
        false,
    ));
    let garbage: Vec<u8> = (0..64u32).map(|i| (i * 97 + 13) as u8).collect();
    cases.push(("garbage with a plausible length", framed(&garbage), false));
    let mut b = header(1);
    b.extend_from_slice(&[9; 13]);
    cases.push(("unknown operation kind", framed(&b), false));
    let mut b = header(0);
    b.push(0);
    cases.push(("trailing byte", framed(&b), false));

    for (name, bytes, eof) in &cases {
        expect_closed(&nic, key, name, bytes, *eof).await;
    }

    // A peer that announces the largest legal frame and then stalls: the NIC must not have
    // allocated the announced 64 MiB while it waits for the rest.
    let mut stall = bound(&nic, key).await;
    let mut start = (MAX_FRAME as u32).to_le_bytes().to_vec();
    start.extend_from_slice(&[0u8; 4096]);
    stall.write_all(&start).await.unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;

    let peak = PEAK.load(Ordering::Relaxed);
    println!("largest single allocation while serving hostile frames: {peak} bytes");
    assert!(
        peak < ALLOC_BOUND,
        "the NIC allocated {peak} bytes at once for hostile frames"
    );
    drop(stall);

    // Every bad frame was counted (the count lands just after the close, so wait for it).
    let want = cases.len() as u64 + 1;
    for _ in 0..200 {
        if nic.bad_frames() >= want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(nic.bad_frames(), want);

    // The well-behaved connection opened before still works, and so does a new one.
    good.write(128, Bytes::from_static(b"after")).await.unwrap();
    assert_eq!(&good.read(64, 6).await.unwrap()[..], b"before");
    let again = TcpFabric::connect(nic.local_addr(), key).await.unwrap();
    assert_eq!(&again.read(128, 5).await.unwrap()[..], b"after");
    // An honest oversized post is refused by the client before it is sent.
    assert!(encode_request(
        1,
        &[Op::Read {
            offset: 0,
            len: u32::MAX
        }]
    )
    .is_err());
    assert!(again.read(0, u32::MAX).await.is_err());
    assert_eq!(&again.read(128, 5).await.unwrap()[..], b"after");
}
