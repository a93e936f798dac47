//! The tcp backend: across hosts without RDMA. A small "NIC" task in the memory node applies
//! READ/WRITE/CAS/FAA against the registered region and does nothing else; the client pipelines
//! posts (many in flight on one connection, matched by request id).
//!
//! Wire format (little-endian), every frame `[u32 body length][body]`:
//! - request body: `u64 id, u32 slot, u64 token, u16 n, n x op`; op = `u8 kind, u64 offset`,
//!   then READ `u32 len`; WRITE `u32 len, bytes`; CAS `u64 expected, u64 new`; FAA `u64 add`.
//! - response body: `u64 id, u8 status`; status 0: `u16 n, n x completion` (`u8 kind`, then
//!   READ `u32 len, bytes`; WRITE nothing; CAS/FAA `u64 old`); otherwise an error:
//!   `u32 slot_or_zero, u64 a, u64 b, u64 c, u16 len, message`.
//!
//! A response is sent only after every WRITE of the post is persisted (see exec.rs).
//!
//! Fencing: the NIC holds the post's grant slot ([`GrantTable::hold`]) from the key check to
//! the end of the apply, and revoking takes the slot exclusively, so when a revoke on the
//! memory node's grant table returns, every post that passed the check with the old key is
//! applied (and persisted), and no later one passes it. A fenced caller's request still in
//! flight is answered with an access error.
//!
//! # Limits (the NIC faces untrusted peers)
//!
//! The NIC listens on a network port before any access key is checked, so every number in a
//! frame is peer-supplied and is checked before anything is allocated by it:
//! - [`MAX_FRAME`] (64 MiB): the largest body of either direction. A longer length prefix is
//!   refused before reading the body, and a body's buffer grows with the bytes that actually
//!   arrive (never beyond twice what arrived or [`FRAME_ALLOC_STEP`], whichever is larger), so
//!   a peer that announces a big frame and sends nothing costs [`FRAME_ALLOC_STEP`] of memory,
//!   not the announced length.
//! - [`MAX_OPS`] (4096): operations in one post. A post must also carry at least the minimal
//!   encoding of each operation it declares before the operation list is allocated.
//! - [`MAX_REPLY`] (= [`MAX_FRAME`]): the response a request asks for (its READ lengths plus
//!   per-completion overhead) must fit in a frame the client would accept; a 4 GiB READ is
//!   refused when decoded, never attempted.
//!
//! [`encode_request`] applies the same limits, so a well-behaved caller gets an error for an
//! oversized post instead of a closed connection. On the NIC, a frame that breaks the framing
//! or these limits, or does not decode, closes its connection: the NIC logs a warning with the
//! peer address and the reason and counts it ([`TcpNic::bad_frames`]). Other connections are
//! not affected. A request that decodes but addresses bytes outside the region (or carries a
//! revoked key) is not a bad frame: it gets an error response and the connection stays.
//! [`decode_request`] and [`decode_response`] are pure functions over bytes (fuzzed in
//! `fuzz/`, target `tcp_frame_decode`).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use crate::error::{FabricError, Result};
use crate::exec;
use crate::grants::GrantTable;
use crate::op::{AccessKey, Completion, Op};
use crate::pm::PmRegion;
use crate::stats::FabricStats;
use crate::Fabric;

/// Largest frame body accepted or sent, in either direction (a WRITE batch is at most a
/// segment, 8 MiB by default).
pub const MAX_FRAME: usize = 64 << 20;
/// Most operations in one post (the wire's u16 count could say 65535; callers post a few).
pub const MAX_OPS: usize = 4096;
/// Largest response body a request may ask for: what a client accepts as a frame.
pub const MAX_REPLY: usize = MAX_FRAME;
/// A frame buffer starts at most this large and then doubles with the bytes received. Larger
/// than a KN's log batch (at most 1 MiB by default), so common frames are read without a copy.
pub const FRAME_ALLOC_STEP: usize = 2 << 20;

/// `u64 id, u32 slot, u64 token, u16 n`.
const REQUEST_HEADER: usize = 22;
/// `u64 id, u8 status, u16 n`.
const RESPONSE_HEADER: usize = 11;
/// The shortest encoded operation (a READ or an empty WRITE: kind, offset, length).
const MIN_OP: usize = 13;

const K_READ: u8 = 1;
const K_WRITE: u8 = 2;
const K_CAS: u8 = 3;
const K_FAA: u8 = 4;

const S_OK: u8 = 0;
const S_ACCESS: u8 = 1;
const S_BOUNDS: u8 = 2;
const S_ALIGN: u8 = 3;
const S_OTHER: u8 = 4;

fn proto(msg: impl Into<String>) -> FabricError {
    FabricError::Protocol(msg.into())
}

fn need(buf: &impl Buf, n: usize) -> Result<()> {
    if buf.remaining() < n {
        Err(proto(format!(
            "frame truncated: need {n} more bytes, have {}",
            buf.remaining()
        )))
    } else {
        Ok(())
    }
}

/// Bytes `op` takes in a request.
fn request_len(op: &Op) -> Result<usize> {
    Ok(match op {
        Op::Read { .. } => 13,
        // Only WRITEs carry data in a request (a READ's length is what comes back).
        Op::Write { data, .. } => {
            u32::try_from(data.len()).map_err(|_| proto("WRITE larger than 4 GiB"))?;
            13 + data.len()
        }
        Op::Cas { .. } => 25,
        Op::Faa { .. } => 17,
    })
}

/// Bytes the completion of `op` takes in a response.
fn reply_len(op: &Op) -> usize {
    match op {
        Op::Read { len, .. } => 5 + *len as usize,
        Op::Write { .. } => 1,
        Op::Cas { .. } | Op::Faa { .. } => 9,
    }
}

fn too_many_ops(n: usize) -> FabricError {
    proto(format!(
        "a post of {n} operations exceeds the limit of {MAX_OPS} per post"
    ))
}

fn reply_too_large(reply: usize) -> FabricError {
    proto(format!(
        "the response would take at least {reply} bytes, more than the {MAX_REPLY}-byte limit \
         (split large READs)"
    ))
}

/// Encodes a request frame (with its length prefix). Refuses posts that break the limits in
/// the module doc, so the NIC never has to close a well-behaved caller's connection.
pub fn encode_request(id: u64, key: AccessKey, ops: &[Op]) -> Result<Bytes> {
    if ops.len() > MAX_OPS {
        return Err(too_many_ops(ops.len()));
    }
    let reply = ops
        .iter()
        .fold(RESPONSE_HEADER, |acc, o| acc.saturating_add(reply_len(o)));
    if reply > MAX_REPLY {
        return Err(reply_too_large(reply));
    }
    let mut body = REQUEST_HEADER;
    for o in ops {
        body = body.saturating_add(request_len(o)?);
    }
    if body > MAX_FRAME {
        return Err(proto(format!(
            "post of {body} bytes exceeds the {MAX_FRAME}-byte frame limit"
        )));
    }
    let mut b = BytesMut::with_capacity(4 + body);
    b.put_u32_le(0);
    b.put_u64_le(id);
    b.put_u32_le(key.slot);
    b.put_u64_le(key.token);
    b.put_u16_le(ops.len() as u16);
    for op in ops {
        match op {
            Op::Read { offset, len } => {
                b.put_u8(K_READ);
                b.put_u64_le(*offset);
                b.put_u32_le(*len);
            }
            Op::Write { offset, data } => {
                b.put_u8(K_WRITE);
                b.put_u64_le(*offset);
                b.put_u32_le(data.len() as u32);
                b.put_slice(data);
            }
            Op::Cas {
                offset,
                expected,
                new,
            } => {
                b.put_u8(K_CAS);
                b.put_u64_le(*offset);
                b.put_u64_le(*expected);
                b.put_u64_le(*new);
            }
            Op::Faa { offset, add } => {
                b.put_u8(K_FAA);
                b.put_u64_le(*offset);
                b.put_u64_le(*add);
            }
        }
    }
    debug_assert_eq!(b.len() - 4, body);
    b[..4].copy_from_slice(&(body as u32).to_le_bytes());
    Ok(b.freeze())
}

/// Decodes a request body (without its length prefix). Pure; every limit of the module doc is
/// checked before anything is allocated by a number read from `b`.
pub fn decode_request(mut b: Bytes) -> Result<(u64, AccessKey, Vec<Op>)> {
    if b.len() > MAX_FRAME {
        return Err(proto(format!(
            "request of {} bytes exceeds the {MAX_FRAME}-byte frame limit",
            b.len()
        )));
    }
    need(&b, REQUEST_HEADER)?;
    let id = b.get_u64_le();
    let slot = b.get_u32_le();
    let token = b.get_u64_le();
    let n = usize::from(b.get_u16_le());
    if n > MAX_OPS {
        return Err(too_many_ops(n));
    }
    if n * MIN_OP > b.remaining() {
        return Err(proto(format!(
            "request declares {n} operations but carries only {} bytes of them",
            b.remaining()
        )));
    }
    let mut ops = Vec::with_capacity(n);
    let mut reply = RESPONSE_HEADER;
    for _ in 0..n {
        need(&b, 9)?;
        let kind = b.get_u8();
        let offset = b.get_u64_le();
        let op = match kind {
            K_READ => {
                need(&b, 4)?;
                Op::Read {
                    offset,
                    len: b.get_u32_le(),
                }
            }
            K_WRITE => {
                need(&b, 4)?;
                let len = b.get_u32_le() as usize;
                need(&b, len)?;
                Op::Write {
                    offset,
                    data: b.split_to(len),
                }
            }
            K_CAS => {
                need(&b, 16)?;
                Op::Cas {
                    offset,
                    expected: b.get_u64_le(),
                    new: b.get_u64_le(),
                }
            }
            K_FAA => {
                need(&b, 8)?;
                Op::Faa {
                    offset,
                    add: b.get_u64_le(),
                }
            }
            k => return Err(proto(format!("unknown operation kind {k}"))),
        };
        reply = reply.saturating_add(reply_len(&op));
        if reply > MAX_REPLY {
            return Err(reply_too_large(reply));
        }
        ops.push(op);
    }
    if b.has_remaining() {
        return Err(proto(format!(
            "{} trailing bytes after the last operation",
            b.remaining()
        )));
    }
    Ok((id, AccessKey { slot, token }, ops))
}

/// Encodes a response frame.
pub fn encode_response(id: u64, result: &Result<Vec<Completion>>) -> Bytes {
    let mut b = BytesMut::with_capacity(64);
    b.put_u32_le(0);
    b.put_u64_le(id);
    match result {
        Ok(cs) => {
            b.put_u8(S_OK);
            b.put_u16_le(cs.len() as u16);
            for c in cs {
                match c {
                    Completion::Read(data) => {
                        b.put_u8(K_READ);
                        b.put_u32_le(data.len() as u32);
                        b.put_slice(data);
                    }
                    Completion::Written => b.put_u8(K_WRITE),
                    Completion::Cas { old } => {
                        b.put_u8(K_CAS);
                        b.put_u64_le(*old);
                    }
                    Completion::Faa { old } => {
                        b.put_u8(K_FAA);
                        b.put_u64_le(*old);
                    }
                }
            }
        }
        Err(e) => {
            let (status, slot, a, bb) = match e {
                FabricError::AccessDenied { slot } => (S_ACCESS, *slot, 0, 0),
                FabricError::OutOfBounds {
                    offset,
                    len,
                    region_len,
                } => {
                    b.put_u8(S_BOUNDS);
                    b.put_u32_le(0);
                    b.put_u64_le(*offset);
                    b.put_u64_le(*len);
                    b.put_u64_le(*region_len);
                    b.put_u16_le(0);
                    return finish(b);
                }
                FabricError::Misaligned { offset } => (S_ALIGN, 0, *offset, 0),
                _ => (S_OTHER, 0, 0, 0),
            };
            let msg = e.to_string();
            let msg = &msg.as_bytes()[..msg.len().min(1024)];
            b.put_u8(status);
            b.put_u32_le(slot);
            b.put_u64_le(a);
            b.put_u64_le(bb);
            b.put_u64_le(0);
            b.put_u16_le(msg.len() as u16);
            b.put_slice(msg);
        }
    }
    finish(b)
}

fn finish(mut b: BytesMut) -> Bytes {
    let body = (b.len() - 4) as u32;
    b[..4].copy_from_slice(&body.to_le_bytes());
    b.freeze()
}

/// Decodes a response body. Pure; like [`decode_request`] it allocates nothing by a count it
/// has not checked against the bytes at hand.
pub fn decode_response(mut b: Bytes) -> Result<(u64, Result<Vec<Completion>>)> {
    if b.len() > MAX_FRAME {
        return Err(proto(format!(
            "response of {} bytes exceeds the {MAX_FRAME}-byte frame limit",
            b.len()
        )));
    }
    need(&b, 9)?;
    let id = b.get_u64_le();
    let status = b.get_u8();
    if status == S_OK {
        need(&b, 2)?;
        let n = usize::from(b.get_u16_le());
        if n > MAX_OPS {
            return Err(too_many_ops(n));
        }
        // Every completion takes at least its kind byte.
        if n > b.remaining() {
            return Err(proto(format!(
                "response declares {n} completions but carries only {} bytes of them",
                b.remaining()
            )));
        }
        let mut cs = Vec::with_capacity(n);
        for _ in 0..n {
            need(&b, 1)?;
            cs.push(match b.get_u8() {
                K_READ => {
                    need(&b, 4)?;
                    let len = b.get_u32_le() as usize;
                    need(&b, len)?;
                    Completion::Read(b.split_to(len))
                }
                K_WRITE => Completion::Written,
                K_CAS => {
                    need(&b, 8)?;
                    Completion::Cas {
                        old: b.get_u64_le(),
                    }
                }
                K_FAA => {
                    need(&b, 8)?;
                    Completion::Faa {
                        old: b.get_u64_le(),
                    }
                }
                k => return Err(proto(format!("unknown completion kind {k}"))),
            });
        }
        if b.has_remaining() {
            return Err(proto(format!(
                "{} trailing bytes after the last completion",
                b.remaining()
            )));
        }
        return Ok((id, Ok(cs)));
    }
    need(&b, 30)?;
    let slot = b.get_u32_le();
    let a = b.get_u64_le();
    let bb = b.get_u64_le();
    let c = b.get_u64_le();
    let len = b.get_u16_le() as usize;
    need(&b, len)?;
    let msg = String::from_utf8_lossy(&b.split_to(len)).into_owned();
    if b.has_remaining() {
        return Err(proto(format!(
            "{} trailing bytes after an error response",
            b.remaining()
        )));
    }
    let err = match status {
        S_ACCESS => FabricError::AccessDenied { slot },
        S_BOUNDS => FabricError::OutOfBounds {
            offset: a,
            len: bb,
            region_len: c,
        },
        S_ALIGN => FabricError::Misaligned { offset: a },
        _ => FabricError::Protocol(format!("remote error: {msg}")),
    };
    Ok((id, Err(err)))
}

/// Why a frame could not be read.
#[derive(Debug)]
enum FrameError {
    /// The peer broke the framing: a length over [`MAX_FRAME`], or a frame cut short.
    Bad(String),
    /// The transport failed.
    Io(std::io::Error),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::Bad(why) => f.write_str(why),
            FrameError::Io(e) => write!(f, "{e}"),
        }
    }
}

/// Reads one frame body; `None` on a clean end of stream (between frames). The body's buffer
/// starts at [`FRAME_ALLOC_STEP`] at most and doubles only when full, so a length prefix alone
/// cannot make the reader allocate the length it announces.
async fn read_frame<R: AsyncRead + Unpin>(
    r: &mut R,
) -> std::result::Result<Option<Bytes>, FrameError> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < len.len() {
        let n = r.read(&mut len[got..]).await.map_err(FrameError::Io)?;
        if n == 0 {
            if got == 0 {
                return Ok(None);
            }
            return Err(FrameError::Bad(format!(
                "stream ended after {got} of a frame's 4 length bytes"
            )));
        }
        got += n;
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(FrameError::Bad(format!(
            "frame of {len} bytes exceeds the {MAX_FRAME}-byte limit"
        )));
    }
    let mut body = BytesMut::with_capacity(len.min(FRAME_ALLOC_STEP));
    while body.len() < len {
        if body.len() == body.capacity() {
            let more = body.len().max(FRAME_ALLOC_STEP).min(len - body.len());
            body.reserve(more);
        }
        let want = (len - body.len()) as u64;
        let n = (&mut *r)
            .take(want)
            .read_buf(&mut body)
            .await
            .map_err(FrameError::Io)?;
        if n == 0 {
            return Err(FrameError::Bad(format!(
                "stream ended after {} of a frame's {len} bytes",
                body.len()
            )));
        }
    }
    Ok(Some(body.freeze()))
}

/// Counters of one NIC, over all its connections.
#[derive(Debug, Default)]
struct NicCounters {
    bad_frames: AtomicU64,
}

/// The memory node's emulated NIC: serves one region to every connection.
#[derive(Debug)]
pub struct TcpNic {
    local_addr: SocketAddr,
    counters: Arc<NicCounters>,
    task: tokio::task::JoinHandle<()>,
}

impl TcpNic {
    /// Binds `addr` and starts serving `region` under the access rules of `grants`.
    pub async fn start(
        addr: SocketAddr,
        region: Arc<PmRegion>,
        grants: Arc<GrantTable>,
    ) -> Result<Self> {
        let listener = TcpListener::bind(addr).await.map_err(|e| {
            FabricError::Transport(format!("binding the fabric NIC to {addr}: {e}"))
        })?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| FabricError::Transport(e.to_string()))?;
        let counters = Arc::new(NicCounters::default());
        let c = counters.clone();
        let task = tokio::spawn(async move {
            loop {
                let (sock, peer) = match listener.accept().await {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "fabric NIC accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = sock.set_nodelay(true);
                let (region, grants, c) = (region.clone(), grants.clone(), c.clone());
                tokio::spawn(async move {
                    match serve_conn(sock, &region, &grants).await {
                        Ok(()) => {}
                        Err(FrameError::Bad(why)) => {
                            c.bad_frames.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(
                                %peer,
                                reason = %why,
                                "fabric NIC: bad frame, closing the connection"
                            );
                        }
                        Err(FrameError::Io(e)) => {
                            tracing::debug!(%peer, error = %e, "fabric connection closed");
                        }
                    }
                });
            }
        });
        Ok(TcpNic {
            local_addr,
            counters,
            task,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Frames refused since start (each closed its connection): export as the counter
    /// `dinomo_fabric_tcp_bad_frames_total`.
    pub fn bad_frames(&self) -> u64 {
        self.counters.bad_frames.load(Ordering::Relaxed)
    }
}

impl Drop for TcpNic {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve_conn(
    sock: TcpStream,
    region: &PmRegion,
    grants: &GrantTable,
) -> std::result::Result<(), FrameError> {
    let (r, w) = sock.into_split();
    let mut r = BufReader::with_capacity(256 << 10, r);
    let mut w = BufWriter::with_capacity(256 << 10, w);
    while let Some(frame) = read_frame(&mut r).await? {
        let (id, key, ops) = decode_request(frame).map_err(|e| match e {
            FabricError::Protocol(why) => FrameError::Bad(why),
            other => FrameError::Bad(other.to_string()),
        })?;
        // The hold spans check and apply, so a revoke (a fence) that returns has seen every
        // post checked against the old key applied; it is released before answering.
        let result = grants.hold(key).and_then(|_hold| {
            grants.run_post_hook(key);
            exec::apply(region, &ops)
        });
        w.write_all(&encode_response(id, &result))
            .await
            .map_err(FrameError::Io)?;
        // Pipelining: answer in bulk while more requests are already buffered.
        if r.buffer().is_empty() {
            w.flush().await.map_err(FrameError::Io)?;
        }
    }
    w.flush().await.map_err(FrameError::Io)
}

type Waiter = oneshot::Sender<Result<Vec<Completion>>>;

/// A caller's tcp handle: one connection, many posts in flight.
#[derive(Debug)]
pub struct TcpFabric {
    key: AccessKey,
    next_id: AtomicU64,
    pending: Arc<Mutex<PendingMap>>,
    outbox: mpsc::UnboundedSender<Bytes>,
    stats: FabricStats,
    reader: tokio::task::JoinHandle<()>,
    writer: tokio::task::JoinHandle<()>,
}

#[derive(Debug, Default)]
struct PendingMap {
    waiters: HashMap<u64, Waiter>,
    /// Set once the connection failed; later posts fail at once with it.
    closed: Option<String>,
}

impl PendingMap {
    fn fail_all(&mut self, why: String) {
        for (_, w) in self.waiters.drain() {
            let _ = w.send(Err(FabricError::Transport(why.clone())));
        }
        self.closed.get_or_insert(why);
    }
}

impl TcpFabric {
    pub async fn connect(addr: SocketAddr, key: AccessKey) -> Result<Self> {
        let sock = TcpStream::connect(addr).await.map_err(|e| {
            FabricError::Transport(format!("connecting to the fabric NIC at {addr}: {e}"))
        })?;
        let _ = sock.set_nodelay(true);
        let (r, w) = sock.into_split();
        let pending = Arc::new(Mutex::new(PendingMap::default()));
        let (outbox, mut rx) = mpsc::unbounded_channel::<Bytes>();

        let p = pending.clone();
        let writer = tokio::spawn(async move {
            let mut w = BufWriter::with_capacity(256 << 10, w);
            while let Some(frame) = rx.recv().await {
                let mut res = w.write_all(&frame).await;
                while res.is_ok() {
                    match rx.try_recv() {
                        Ok(f) => res = w.write_all(&f).await,
                        Err(_) => break,
                    }
                }
                if let Err(e) = res.and(w.flush().await) {
                    p.lock()
                        .fail_all(format!("fabric connection to {addr} failed: {e}"));
                    return;
                }
            }
        });

        let p = pending.clone();
        let reader = tokio::spawn(async move {
            let mut r = BufReader::with_capacity(256 << 10, r);
            let why = loop {
                match read_frame(&mut r).await {
                    Ok(Some(frame)) => match decode_response(frame) {
                        Ok((id, result)) => {
                            if let Some(w) = p.lock().waiters.remove(&id) {
                                let _ = w.send(result);
                            }
                        }
                        Err(e) => break e.to_string(),
                    },
                    Ok(None) => break format!("fabric connection to {addr} closed by the peer"),
                    Err(e) => break format!("fabric connection to {addr} failed: {e}"),
                }
            };
            p.lock().fail_all(why);
        });

        Ok(TcpFabric {
            key,
            next_id: AtomicU64::new(1),
            pending,
            outbox,
            stats: FabricStats::default(),
            reader,
            writer,
        })
    }
}

impl Drop for TcpFabric {
    fn drop(&mut self) {
        self.reader.abort();
        self.writer.abort();
    }
}

#[async_trait]
impl Fabric for TcpFabric {
    async fn post(&self, ops: &[Op]) -> Result<Vec<Completion>> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = encode_request(id, self.key, ops)?;
        let (tx, rx) = oneshot::channel();
        {
            let mut p = self.pending.lock();
            if let Some(why) = &p.closed {
                return Err(FabricError::Transport(why.clone()));
            }
            p.waiters.insert(id, tx);
        }
        self.stats.record_post(ops);
        if self.outbox.send(frame).is_err() {
            self.pending.lock().waiters.remove(&id);
            return Err(FabricError::Transport(
                "fabric connection writer stopped".into(),
            ));
        }
        rx.await
            .map_err(|_| FabricError::Transport("fabric connection dropped the request".into()))?
    }

    fn stats(&self) -> &FabricStats {
        &self.stats
    }

    fn backend(&self) -> &'static str {
        "tcp"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_roundtrip() {
        let ops = vec![
            Op::Read { offset: 8, len: 16 },
            Op::Write {
                offset: 64,
                data: Bytes::from_static(b"abc"),
            },
            Op::Cas {
                offset: 128,
                expected: 1,
                new: 2,
            },
            Op::Faa {
                offset: 136,
                add: 5,
            },
        ];
        let key = AccessKey { slot: 3, token: 99 };
        let f = encode_request(7, key, &ops).unwrap();
        let (id, k, o) = decode_request(f.slice(4..)).unwrap();
        assert_eq!((id, k, o), (7, key, ops));
    }

    #[test]
    fn response_roundtrip_and_errors() {
        let cs = vec![
            Completion::Read(Bytes::from_static(b"xy")),
            Completion::Written,
            Completion::Cas { old: 4 },
            Completion::Faa { old: 9 },
        ];
        let (id, r) = decode_response(encode_response(5, &Ok(cs.clone())).slice(4..)).unwrap();
        assert_eq!(id, 5);
        assert_eq!(r.unwrap(), cs);
        for e in [
            FabricError::AccessDenied { slot: 2 },
            FabricError::OutOfBounds {
                offset: 1,
                len: 2,
                region_len: 3,
            },
            FabricError::Misaligned { offset: 3 },
        ] {
            let want = e.to_string();
            let (_, r) = decode_response(encode_response(1, &Err(e)).slice(4..)).unwrap();
            assert_eq!(r.unwrap_err().to_string(), want);
        }
    }

    #[test]
    fn truncated_frames_are_errors_not_panics() {
        let f = encode_request(
            1,
            AccessKey { slot: 0, token: 1 },
            &[Op::Write {
                offset: 0,
                data: Bytes::from_static(b"hello"),
            }],
        )
        .unwrap();
        for cut in 4..f.len() - 1 {
            assert!(decode_request(f.slice(4..cut)).is_err(), "cut at {cut}");
        }
    }

    fn header(n: u16) -> BytesMut {
        let mut b = BytesMut::new();
        b.put_u64_le(1);
        b.put_u32_le(0);
        b.put_u64_le(1);
        b.put_u16_le(n);
        b
    }

    fn read_op(b: &mut BytesMut, len: u32) {
        b.put_u8(K_READ);
        b.put_u64_le(0);
        b.put_u32_le(len);
    }

    fn err_text<T: std::fmt::Debug>(r: Result<T>) -> String {
        r.unwrap_err().to_string()
    }

    #[test]
    fn declared_op_count_is_checked_against_the_bytes_before_allocating() {
        // The largest count the u16 field can declare, with one op's worth of bytes.
        let mut b = header(u16::MAX);
        read_op(&mut b, 8);
        let e = err_text(decode_request(b.freeze()));
        assert!(e.contains("65535 operations"), "{e}");
        // Within the count limit but with too few bytes for the declared ops.
        let mut b = header(MAX_OPS as u16);
        read_op(&mut b, 8);
        let e = err_text(decode_request(b.freeze()));
        assert!(e.contains("carries only 13 bytes"), "{e}");
        // Garbage where the count is: `ff ff ff ff` (the 2^32-1 a u32 reader would see).
        let mut b = header(0);
        b.truncate(REQUEST_HEADER - 2);
        b.put_slice(&[0xff; 4]);
        assert!(decode_request(b.freeze()).is_err());
    }

    #[test]
    fn reads_whose_reply_exceeds_the_limit_are_refused() {
        let mut b = header(1);
        read_op(&mut b, u32::MAX);
        let e = err_text(decode_request(b.freeze()));
        assert!(e.contains("more than the"), "{e}");
        // Two READs that each fit but together do not.
        let half = (MAX_REPLY / 2) as u32;
        let mut b = header(2);
        read_op(&mut b, half);
        read_op(&mut b, half);
        assert!(decode_request(b.freeze()).is_err());
        // The largest READ that fits is accepted, and encode agrees with decode.
        let max = (MAX_REPLY - RESPONSE_HEADER - 5) as u32;
        let key = AccessKey { slot: 0, token: 1 };
        let ok = [Op::Read {
            offset: 0,
            len: max,
        }];
        let f = encode_request(1, key, &ok).unwrap();
        assert!(decode_request(f.slice(4..)).is_ok());
        let too_big = [Op::Read {
            offset: 0,
            len: max + 1,
        }];
        assert!(encode_request(1, key, &too_big).is_err());
    }

    #[test]
    fn encode_refuses_what_decode_would_refuse() {
        let key = AccessKey { slot: 0, token: 1 };
        let ops = vec![Op::Faa { offset: 0, add: 1 }; MAX_OPS];
        let f = encode_request(1, key, &ops).unwrap();
        assert_eq!(decode_request(f.slice(4..)).unwrap().2.len(), MAX_OPS);
        let ops = vec![Op::Faa { offset: 0, add: 1 }; MAX_OPS + 1];
        assert!(encode_request(1, key, &ops).is_err());
        let big = [Op::Write {
            offset: 0,
            data: Bytes::from(vec![0u8; MAX_FRAME]),
        }];
        assert!(encode_request(1, key, &big).is_err());
    }

    #[test]
    fn responses_check_counts_and_trailing_bytes() {
        let mut b = BytesMut::new();
        b.put_u64_le(1);
        b.put_u8(S_OK);
        b.put_u16_le(u16::MAX);
        assert!(decode_response(b.clone().freeze()).is_err());
        let ok = encode_response(1, &Ok(vec![Completion::Written]));
        let mut long = BytesMut::from(&ok[4..]);
        long.put_u8(0);
        assert!(decode_response(long.freeze()).is_err());
    }

    #[tokio::test]
    async fn frame_reader_refuses_long_and_truncated_frames() {
        let mut long: &[u8] = &((MAX_FRAME as u32 + 1).to_le_bytes());
        assert!(matches!(
            read_frame(&mut long).await,
            Err(FrameError::Bad(_))
        ));
        let mut cut: &[u8] = &[10, 0, 0, 0, 1, 2, 3];
        let e = read_frame(&mut cut).await.unwrap_err();
        assert!(
            e.to_string().contains("after 3 of a frame's 10 bytes"),
            "{e}"
        );
        let mut cut_len: &[u8] = &[10, 0];
        assert!(matches!(
            read_frame(&mut cut_len).await,
            Err(FrameError::Bad(_))
        ));
        let mut empty: &[u8] = &[];
        assert!(read_frame(&mut empty).await.unwrap().is_none());
        // A frame larger than the first allocation step arrives whole.
        let n = FRAME_ALLOC_STEP * 3 + 5;
        let mut v = (n as u32).to_le_bytes().to_vec();
        v.extend((0..n).map(|i| i as u8));
        let mut r: &[u8] = &v;
        let body = read_frame(&mut r).await.unwrap().unwrap();
        assert_eq!(&body[..], &v[4..]);
    }
}
