//! The side channel: the small TCP conversation beside each queue pair that sets it up, tells
//! the caller its memory regions, and restarts the QP after the device refused a request. It
//! is not the data path: READ, WRITE, CAS and FAA never touch it.
//!
//! # Format (version 3, little-endian, every message `[u32 body length][body]`, body ≤ 4096)
//!
//! Handshake, once per connection:
//! - hello (caller to node): `u64 magic "DNMVERBS"`, `u16 version (3)`, `u32 slot`,
//!   `u32 generation`, `[u8; 16] secret`, endpoint.
//! - reply: `u64 magic`, `u8 status`; status 0: endpoint, `u32 read rkey`, `u64 remote base`,
//!   `u64 region length`; status 1 (access denied): `u32 slot`; status 2 (node error):
//!   `u16 len`, message (UTF-8). After status 1 or 2 the node closes the connection.
//!
//! Requests, any number after the handshake, one at a time (the node answers each before it
//! reads the next):
//! - `u8 kind`: 1 = WINDOW ("window please": the node re-reads the key's write window in the
//!   grant table, registers a memory region for each range it has none for, deregisters those
//!   whose range left the window, and lists them); 2 = RESTART followed by an endpoint (the
//!   caller's QP, taken back through RESET with a new PSN after the device refused one of its
//!   requests: the node restarts its QP towards it, then does what WINDOW does).
//! - answer: `u8 status`; status 0: for RESTART the node's endpoint first, then `u16 n` and n
//!   window entries; status 1 (the key is no longer valid): `u32 slot`; status 2: `u16 len`,
//!   message. After status 1 or 2 the node closes the connection.
//! - window entry (21 bytes): `u64 offset`, `u64 len` (region offsets), `u8 access` (0: WRITE,
//!   CAS and FAA; 1: atomics only, the cell space), `u32 rkey` of the memory region that covers
//!   exactly that range.
//!
//! Endpoint (28 bytes): `u32 qpn`, `u32 psn`, `u16 lid`, `[u8; 16] gid`, `u8 mtu` (ibv_mtu),
//! `u8 rd_atomic` (outstanding READs/atomics the sender takes as responder).
//!
//! Version 2 had no requests: its one rkey allowed WRITE and atomics over the whole region.
//! Version 1 had a `u64 token` instead of generation and secret. A node answers another
//! version with status 2 naming both.

use std::io::{Read, Write};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use sideway::ibverbs::address::Gid;
use sideway::ibverbs::device_context::Mtu;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{proto, transport};
use crate::error::{FabricError, Result};
use crate::grants::{WindowAccess, WindowRange, MAX_WINDOW_RANGES};
use crate::op::AccessKey;

pub(super) const MAGIC: u64 = u64::from_le_bytes(*b"DNMVERBS");
pub(super) const VERSION: u16 = 3;
const MAX_MSG: usize = 4096;
/// How long one side waits for the other's message once a conversation has started.
pub(super) const SIDE_TIMEOUT: Duration = Duration::from_secs(10);

pub(super) const ST_OK: u8 = 0;
pub(super) const ST_DENIED: u8 = 1;
pub(super) const ST_ERROR: u8 = 2;

pub(super) const REQ_WINDOW: u8 = 1;
pub(super) const REQ_RESTART: u8 = 2;

const ACCESS_WRITE: u8 = 0;
const ACCESS_ATOMIC: u8 = 1;

/// One side's queue pair address, as exchanged on the side channel.
#[derive(Debug, Clone, Copy)]
pub(super) struct Endpoint {
    pub(super) qpn: u32,
    pub(super) psn: u32,
    pub(super) lid: u16,
    pub(super) gid: Gid,
    pub(super) mtu: u8,
    pub(super) rd_atomic: u8,
}

impl Endpoint {
    pub(super) fn put(&self, b: &mut BytesMut) {
        b.put_u32_le(self.qpn);
        b.put_u32_le(self.psn);
        b.put_u16_le(self.lid);
        b.put_slice(&self.gid.raw);
        b.put_u8(self.mtu);
        b.put_u8(self.rd_atomic);
    }

    pub(super) fn get(b: &mut Bytes) -> Result<Self> {
        need(b, 4 + 4 + 2 + 16 + 2)?;
        let qpn = b.get_u32_le();
        let psn = b.get_u32_le();
        let lid = b.get_u16_le();
        let mut gid = Gid::default();
        b.copy_to_slice(&mut gid.raw);
        let mtu = b.get_u8();
        let rd_atomic = b.get_u8();
        let ep = Endpoint {
            qpn,
            psn,
            lid,
            gid,
            mtu,
            rd_atomic,
        };
        ep.mtu()?;
        Ok(ep)
    }

    pub(super) fn mtu(&self) -> Result<Mtu> {
        Ok(match self.mtu {
            1 => Mtu::Mtu256,
            2 => Mtu::Mtu512,
            3 => Mtu::Mtu1024,
            4 => Mtu::Mtu2048,
            5 => Mtu::Mtu4096,
            m => {
                return Err(proto(format!(
                    "peer announced an unknown path MTU code {m}"
                )))
            }
        })
    }
}

/// One memory region of a caller's write window, as the node announces it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct WindowMr {
    pub(super) range: WindowRange,
    pub(super) rkey: u32,
}

pub(super) fn put_window(b: &mut BytesMut, window: &[WindowMr]) {
    debug_assert!(window.len() <= MAX_WINDOW_RANGES);
    b.put_u16_le(window.len() as u16);
    for w in window {
        b.put_u64_le(w.range.offset);
        b.put_u64_le(w.range.len);
        b.put_u8(match w.range.access {
            WindowAccess::Write => ACCESS_WRITE,
            WindowAccess::Atomic => ACCESS_ATOMIC,
        });
        b.put_u32_le(w.rkey);
    }
}

pub(super) fn get_window(b: &mut Bytes) -> Result<Vec<WindowMr>> {
    need(b, 2)?;
    let n = usize::from(b.get_u16_le());
    if n > MAX_WINDOW_RANGES {
        return Err(proto(format!(
            "the node announced {n} window regions (a window has at most {MAX_WINDOW_RANGES})"
        )));
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        need(b, 8 + 8 + 1 + 4)?;
        let offset = b.get_u64_le();
        let len = b.get_u64_le();
        let access = match b.get_u8() {
            ACCESS_WRITE => WindowAccess::Write,
            ACCESS_ATOMIC => WindowAccess::Atomic,
            a => return Err(proto(format!("unknown window access code {a}"))),
        };
        let rkey = b.get_u32_le();
        if len == 0 || offset.checked_add(len).is_none() {
            return Err(proto(format!(
                "the node announced an empty or overflowing window range ({len} bytes at {offset})"
            )));
        }
        out.push(WindowMr {
            range: WindowRange {
                offset,
                len,
                access,
            },
            rkey,
        });
    }
    Ok(out)
}

/// The hello's body.
pub(super) fn put_hello(b: &mut BytesMut, key: AccessKey, local: &Endpoint) {
    b.put_u64_le(MAGIC);
    b.put_u16_le(VERSION);
    b.put_u32_le(key.slot);
    b.put_u32_le(key.generation);
    b.put_slice(&key.secret);
    local.put(b);
}

pub(super) fn put_denied(b: &mut BytesMut, slot: u32) {
    b.put_u8(ST_DENIED);
    b.put_u32_le(slot);
}

pub(super) fn put_error(b: &mut BytesMut, msg: &str) {
    let msg = &msg.as_bytes()[..msg.len().min(1024)];
    b.put_u8(ST_ERROR);
    b.put_u16_le(msg.len() as u16);
    b.put_slice(msg);
}

/// Reads a status byte: `Ok` for status 0, the node's refusal as an error otherwise (`what`
/// names the conversation for the message).
pub(super) fn get_status(b: &mut Bytes, what: &str) -> Result<()> {
    need(b, 1)?;
    match b.get_u8() {
        ST_OK => Ok(()),
        ST_DENIED => {
            need(b, 4)?;
            Err(FabricError::AccessDenied {
                slot: b.get_u32_le(),
            })
        }
        ST_ERROR => {
            need(b, 2)?;
            let n = usize::from(b.get_u16_le());
            need(b, n)?;
            let msg = String::from_utf8_lossy(&b.split_to(n)).into_owned();
            Err(transport(format!("the verbs node refused {what}: {msg}")))
        }
        s => Err(proto(format!("unknown side-channel status {s} ({what})"))),
    }
}

pub(super) fn need(b: &Bytes, n: usize) -> Result<()> {
    if b.remaining() < n {
        Err(proto(format!(
            "side-channel message truncated: need {n} more bytes, have {}",
            b.remaining()
        )))
    } else {
        Ok(())
    }
}

pub(super) fn check_magic(b: &mut Bytes) -> Result<()> {
    need(b, 8)?;
    let m = b.get_u64_le();
    if m != MAGIC {
        return Err(proto(format!(
            "not a verbs fabric handshake (magic {m:#x})"
        )));
    }
    Ok(())
}

fn frame(body: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(4 + body.len());
    b.extend_from_slice(&(body.len() as u32).to_le_bytes());
    b.extend_from_slice(body);
    b
}

fn body_len(len: [u8; 4]) -> std::io::Result<usize> {
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_MSG {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("side-channel message of {len} bytes exceeds {MAX_MSG}"),
        ));
    }
    Ok(len)
}

pub(super) async fn write_msg(sock: &mut TcpStream, body: &[u8]) -> Result<()> {
    sock.write_all(&frame(body))
        .await
        .map_err(|e| transport(format!("side channel write: {e}")))
}

async fn read_body(sock: &mut TcpStream, len: [u8; 4]) -> std::io::Result<Bytes> {
    let mut body = vec![0u8; body_len(len)?];
    sock.read_exact(&mut body).await?;
    Ok(Bytes::from(body))
}

/// Reads one message, waiting at most [`SIDE_TIMEOUT`] (a handshake in progress).
pub(super) async fn read_msg(sock: &mut TcpStream) -> Result<Bytes> {
    let io = async {
        let mut len = [0u8; 4];
        sock.read_exact(&mut len).await?;
        read_body(sock, len).await
    };
    match tokio::time::timeout(SIDE_TIMEOUT, io).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => Err(transport(format!("side channel read: {e}"))),
        Err(_) => Err(transport(format!(
            "side channel: no answer within {SIDE_TIMEOUT:?}"
        ))),
    }
}

/// Waits (without a deadline: a caller may stay idle for days) for the caller's next request;
/// `None` when it closed the channel. Once a request has begun, its rest must come within
/// [`SIDE_TIMEOUT`].
pub(super) async fn read_request(sock: &mut TcpStream) -> Result<Option<Bytes>> {
    let mut len = [0u8; 4];
    match sock.read(&mut len[..1]).await {
        Ok(0) => return Ok(None),
        Ok(_) => {}
        Err(e) => return Err(transport(format!("side channel: {e}"))),
    }
    let rest = async {
        sock.read_exact(&mut len[1..]).await?;
        read_body(sock, len).await
    };
    match tokio::time::timeout(SIDE_TIMEOUT, rest).await {
        Ok(Ok(b)) => Ok(Some(b)),
        Ok(Err(e)) => Err(transport(format!("side channel read: {e}"))),
        Err(_) => Err(transport(format!(
            "side channel: a request did not arrive whole within {SIDE_TIMEOUT:?}"
        ))),
    }
}

/// The caller's end of the side channel after the handshake: blocking, used only by the thread
/// that holds the connection (a post in `spawn_blocking`), so a request is never abandoned
/// half-way by a dropped future.
#[derive(Debug)]
pub(super) struct SideChannel {
    sock: std::net::TcpStream,
}

impl SideChannel {
    pub(super) fn new(sock: TcpStream) -> Result<Self> {
        let sock = sock
            .into_std()
            .map_err(|e| transport(format!("side channel: {e}")))?;
        sock.set_nonblocking(false)
            .and_then(|()| sock.set_read_timeout(Some(SIDE_TIMEOUT)))
            .and_then(|()| sock.set_write_timeout(Some(SIDE_TIMEOUT)))
            .map_err(|e| transport(format!("side channel: {e}")))?;
        Ok(SideChannel { sock })
    }

    /// Sends one request and reads its answer.
    pub(super) fn ask(&mut self, body: &[u8]) -> Result<Bytes> {
        let io = (|| {
            self.sock.write_all(&frame(body))?;
            let mut len = [0u8; 4];
            self.sock.read_exact(&mut len)?;
            let mut b = vec![0u8; body_len(len)?];
            self.sock.read_exact(&mut b)?;
            Ok::<_, std::io::Error>(Bytes::from(b))
        })();
        io.map_err(|e| transport(format!("side channel: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_roundtrip_and_bad_mtu() {
        let ep = Endpoint {
            qpn: 17,
            psn: 0x12345,
            lid: 3,
            gid: Gid { raw: [7; 16] },
            mtu: 3,
            rd_atomic: 16,
        };
        let mut b = BytesMut::new();
        ep.put(&mut b);
        let back = Endpoint::get(&mut b.clone().freeze()).unwrap();
        assert_eq!(
            (
                back.qpn,
                back.psn,
                back.lid,
                back.gid,
                back.mtu,
                back.rd_atomic
            ),
            (17, 0x12345, 3, ep.gid, 3, 16)
        );
        let mut bad = b.to_vec();
        bad[26] = 9;
        assert!(Endpoint::get(&mut Bytes::from(bad)).is_err());
        for cut in 0..b.len() {
            assert!(Endpoint::get(&mut b.clone().freeze().slice(..cut)).is_err());
        }
    }

    #[test]
    fn window_entries_roundtrip_and_refuse_garbage() {
        let w = vec![
            WindowMr {
                range: WindowRange::write(1 << 20, 256 << 10),
                rkey: 0xdead,
            },
            WindowMr {
                range: WindowRange::atomic(4096, 64),
                rkey: 7,
            },
        ];
        let mut b = BytesMut::new();
        put_window(&mut b, &w);
        assert_eq!(b.len(), 2 + 2 * 21, "the documented entry size");
        assert_eq!(get_window(&mut b.clone().freeze()).unwrap(), w);
        for cut in 0..b.len() {
            assert!(get_window(&mut b.clone().freeze().slice(..cut)).is_err());
        }
        let mut bad = b.to_vec();
        bad[2 + 16] = 9; // access code
        assert!(get_window(&mut Bytes::from(bad)).is_err());
        let mut empty = b.to_vec();
        empty[2 + 8..2 + 16].fill(0); // len 0
        assert!(get_window(&mut Bytes::from(empty)).is_err());
        let mut many = BytesMut::new();
        many.put_u16_le(MAX_WINDOW_RANGES as u16 + 1);
        assert!(get_window(&mut many.freeze()).is_err());
    }

    #[test]
    fn statuses_map_to_errors() {
        let mut b = BytesMut::new();
        put_denied(&mut b, 5);
        assert!(matches!(
            get_status(&mut b.freeze(), "x"),
            Err(FabricError::AccessDenied { slot: 5 })
        ));
        let mut b = BytesMut::new();
        put_error(&mut b, "no such thing");
        let e = get_status(&mut b.freeze(), "a window")
            .unwrap_err()
            .to_string();
        assert!(e.contains("no such thing") && e.contains("a window"), "{e}");
        assert!(get_status(&mut Bytes::from_static(&[0]), "x").is_ok());
        assert!(matches!(
            get_status(&mut Bytes::from_static(&[9]), "x"),
            Err(FabricError::Protocol(_))
        ));
    }
}
