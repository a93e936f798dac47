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

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use async_trait::async_trait;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};

use crate::error::{FabricError, Result};
use crate::exec;
use crate::grants::GrantTable;
use crate::op::{AccessKey, Completion, Op};
use crate::pm::PmRegion;
use crate::stats::FabricStats;
use crate::Fabric;

/// Frames larger than this are refused (a WRITE batch is at most a segment, 8 MiB by default).
pub const MAX_FRAME: usize = 64 << 20;

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

/// Encodes a request frame (with its length prefix).
pub fn encode_request(id: u64, key: AccessKey, ops: &[Op]) -> Result<Bytes> {
    let n =
        u16::try_from(ops.len()).map_err(|_| proto("more than 65535 operations in one post"))?;
    // Only WRITEs carry data in a request (a READ's length is what comes back).
    let payload: usize = ops
        .iter()
        .map(|o| {
            25 + if let Op::Write { data, .. } = o {
                data.len()
            } else {
                0
            }
        })
        .sum();
    let mut b = BytesMut::with_capacity(4 + 22 + payload);
    b.put_u32_le(0);
    b.put_u64_le(id);
    b.put_u32_le(key.slot);
    b.put_u64_le(key.token);
    b.put_u16_le(n);
    for op in ops {
        match op {
            Op::Read { offset, len } => {
                b.put_u8(K_READ);
                b.put_u64_le(*offset);
                b.put_u32_le(*len);
            }
            Op::Write { offset, data } => {
                let len =
                    u32::try_from(data.len()).map_err(|_| proto("WRITE larger than 4 GiB"))?;
                b.put_u8(K_WRITE);
                b.put_u64_le(*offset);
                b.put_u32_le(len);
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
    let body = b.len() - 4;
    if body > MAX_FRAME {
        return Err(proto(format!(
            "post of {body} bytes exceeds the {MAX_FRAME}-byte frame limit"
        )));
    }
    b[..4].copy_from_slice(&(body as u32).to_le_bytes());
    Ok(b.freeze())
}

/// Decodes a request body (without its length prefix).
pub fn decode_request(mut b: Bytes) -> Result<(u64, AccessKey, Vec<Op>)> {
    need(&b, 22)?;
    let id = b.get_u64_le();
    let slot = b.get_u32_le();
    let token = b.get_u64_le();
    let n = b.get_u16_le();
    let mut ops = Vec::with_capacity(usize::from(n));
    for _ in 0..n {
        need(&b, 9)?;
        let kind = b.get_u8();
        let offset = b.get_u64_le();
        ops.push(match kind {
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
        });
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

/// Decodes a response body.
pub fn decode_response(mut b: Bytes) -> Result<(u64, Result<Vec<Completion>>)> {
    need(&b, 9)?;
    let id = b.get_u64_le();
    let status = b.get_u8();
    if status == S_OK {
        need(&b, 2)?;
        let n = b.get_u16_le();
        let mut cs = Vec::with_capacity(usize::from(n));
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

async fn read_frame<R: AsyncReadExt + Unpin>(r: &mut R) -> std::io::Result<Option<Bytes>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds {MAX_FRAME}"),
        ));
    }
    let mut body = vec![0u8; len];
    r.read_exact(&mut body).await?;
    Ok(Some(Bytes::from(body)))
}

/// The memory node's emulated NIC: serves one region to every connection.
#[derive(Debug)]
pub struct TcpNic {
    local_addr: SocketAddr,
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
                let (region, grants) = (region.clone(), grants.clone());
                tokio::spawn(async move {
                    if let Err(e) = serve_conn(sock, &region, &grants).await {
                        tracing::debug!(%peer, error = %e, "fabric connection closed");
                    }
                });
            }
        });
        Ok(TcpNic { local_addr, task })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
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
) -> std::io::Result<()> {
    let (r, w) = sock.into_split();
    let mut r = BufReader::with_capacity(256 << 10, r);
    let mut w = BufWriter::with_capacity(256 << 10, w);
    while let Some(frame) = read_frame(&mut r).await? {
        let (id, result) = match decode_request(frame) {
            Ok((id, key, ops)) => (
                id,
                grants.check(key).and_then(|()| exec::apply(region, &ops)),
            ),
            Err(e) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    e.to_string(),
                ));
            }
        };
        w.write_all(&encode_response(id, &result)).await?;
        // Pipelining: answer in bulk while more requests are already buffered.
        if r.buffer().is_empty() {
            w.flush().await?;
        }
    }
    w.flush().await
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
}
