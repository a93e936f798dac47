//! The tcp backend: across hosts without RDMA. A small "NIC" task in the memory node applies
//! READ/WRITE/CAS/FAA against the registered region and does nothing else; the client pipelines
//! posts (many in flight on one connection, matched by request id).
//!
//! Wire format, version 2 (little-endian):
//! - hello (client to NIC, first thing on a connection, unframed, [`HELLO_LEN`] bytes):
//!   `u64 magic "DNMFABRC", u16 version, u32 slot, u32 generation, [u8; 16] secret`. The NIC
//!   answers one byte: [`HELLO_OK`], or [`HELLO_DENIED`] / [`HELLO_UNSUPPORTED`] and closes.
//! - then every frame `[u32 body length][body]`:
//!   - request body: `u64 id, u16 n, n x op`; op = `u8 kind, u64 offset`, then READ `u32 len`;
//!     WRITE `u32 len, bytes`; CAS `u64 expected, u64 new`; FAA `u64 add`.
//!   - response body: `u64 id, u8 status`; status 0: `u16 n, n x completion` (`u8 kind`, then
//!     READ `u32 len, bytes`; WRITE nothing; CAS/FAA `u64 old`); otherwise an error:
//!     `u32 slot_or_zero, u64 a, u64 b, u64 c, u16 len, message`.
//!
//! Version 1 carried a 64-bit token in every request; version 2 checks the key once, in the
//! hello, and binds the connection to that grant slot. A response is sent only after every
//! WRITE of the post is persisted (see exec.rs).
//!
//! Access: the hello's key is checked once (the secret in constant time). Every post on the
//! bound connection still takes the slot's hold ([`GrantTable::hold`]), which re-checks the key,
//! and checks each WRITE/CAS/FAA against the key's write window, from before the apply to its
//! end. Revoking the key or closing a window range takes the slot exclusively, so when either
//! returns on the memory node's grant table, every post that passed the check under the old
//! grant is applied (and persisted), and no later one passes it. A fenced caller's request
//! still in flight is answered with an access error; a WRITE outside the window with
//! [`FabricError::OutsideWindow`] (nothing of that post applied).
//!
//! Wrong hellos: a wrong hello is answered (one "denied" byte, then the connection is closed)
//! only after a delay that doubles with its IP's refusals in a row, from
//! [`NicOptions::hello_delay_base`] (100 ms) to [`NicOptions::hello_delay_max`] (10 s): a
//! tarpit that slows down guessing from that IP. A correct hello is answered at once, even from
//! an IP with refusals (KNs of one host share an IP, and a KN reconnecting with the key of a
//! memory node that restarted is refused once), and resets the count, and so do 10 minutes
//! without a refusal; at most 4096 IPs are remembered (the longest
//! quiet is forgotten first). Refusals are counted ([`TcpNic::denied`], exported as
//! `dinomo_fabric_tcp_denied_total`). The hello and the data travel in clear: the tcp fabric
//! belongs on a trusted network.
//!
//! # Limits (the NIC faces untrusted peers)
//!
//! The NIC listens on a network port, so every number in a frame is peer-supplied and is
//! checked before anything is allocated by it (a hello must also arrive within
//! [`NicOptions::hello_timeout`]):
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
//! not affected. A request that decodes but addresses bytes outside the region or the window
//! (or runs into a revoked key) is not a bad frame: it gets an error response and the
//! connection stays. [`decode_request`] and [`decode_response`] are pure functions over bytes
//! (fuzzed in `fuzz/`, target `tcp_frame_decode`).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

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

/// `u64 magic, u16 version, u32 slot, u32 generation, [u8; 16] secret`.
pub const HELLO_LEN: usize = 34;
/// The hello's magic, "DNMFABRC".
const HELLO_MAGIC: u64 = u64::from_le_bytes(*b"DNMFABRC");
/// The wire version this build speaks (2: key in the hello, none per frame).
pub const WIRE_VERSION: u16 = 2;
/// The NIC's answer to a hello it accepts; the connection is bound to the hello's slot.
pub const HELLO_OK: u8 = 0;
/// The NIC's answer to a hello whose key it refuses; it closes the connection.
pub const HELLO_DENIED: u8 = 1;
/// The NIC's answer to a hello of another magic or version; it closes the connection.
pub const HELLO_UNSUPPORTED: u8 = 2;

/// `u64 id, u16 n`.
const REQUEST_HEADER: usize = 10;
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
/// A transient failure at the memory node (its replicas did not acknowledge): the post's
/// outcome is unknown, and the caller may retry on a new session. Decoded as
/// [`FabricError::Transport`]; a version-2 peer that predates it reads a protocol error.
const S_WINDOW: u8 = 5;
const S_TRANSPORT: u8 = 6;

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
pub fn encode_request(id: u64, ops: &[Op]) -> Result<Bytes> {
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
pub fn decode_request(mut b: Bytes) -> Result<(u64, Vec<Op>)> {
    if b.len() > MAX_FRAME {
        return Err(proto(format!(
            "request of {} bytes exceeds the {MAX_FRAME}-byte frame limit",
            b.len()
        )));
    }
    need(&b, REQUEST_HEADER)?;
    let id = b.get_u64_le();
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
    Ok((id, ops))
}

/// The hello a client sends first on a connection (see the module doc).
pub fn encode_hello(key: AccessKey) -> [u8; HELLO_LEN] {
    let mut b = [0u8; HELLO_LEN];
    b[..8].copy_from_slice(&HELLO_MAGIC.to_le_bytes());
    b[8..10].copy_from_slice(&WIRE_VERSION.to_le_bytes());
    b[10..14].copy_from_slice(&key.slot.to_le_bytes());
    b[14..18].copy_from_slice(&key.generation.to_le_bytes());
    b[18..].copy_from_slice(&key.secret);
    b
}

/// Decodes a hello: the key, or `Err(version)` for another magic (`None`) or version.
pub fn decode_hello(b: &[u8; HELLO_LEN]) -> std::result::Result<AccessKey, Option<u16>> {
    let magic = u64::from_le_bytes(b[..8].try_into().expect("8"));
    if magic != HELLO_MAGIC {
        return Err(None);
    }
    let version = u16::from_le_bytes(b[8..10].try_into().expect("2"));
    if version != WIRE_VERSION {
        return Err(Some(version));
    }
    Ok(AccessKey {
        slot: u32::from_le_bytes(b[10..14].try_into().expect("4")),
        generation: u32::from_le_bytes(b[14..18].try_into().expect("4")),
        secret: b[18..].try_into().expect("16"),
    })
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
                FabricError::OutsideWindow { slot, offset, len } => {
                    (S_WINDOW, *slot, *offset, *len)
                }
                FabricError::Transport(_) | FabricError::TimedOut { .. } => (S_TRANSPORT, 0, 0, 0),
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
        S_WINDOW => FabricError::OutsideWindow {
            slot,
            offset: a,
            len: bb,
        },
        S_TRANSPORT => FabricError::Transport(format!("at the memory node: {msg}")),
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
    denied: AtomicU64,
}

/// How the NIC treats hellos (see the module doc). Tests shorten the delays.
#[derive(Debug, Clone)]
pub struct NicOptions {
    /// The delay after a peer IP's first refused hello; it doubles with each further refusal.
    pub hello_delay_base: Duration,
    /// The longest delay.
    pub hello_delay_max: Duration,
    /// A peer IP without a refusal for this long starts over.
    pub hello_forget_after: Duration,
    /// Peer IPs remembered at most (the one refused longest ago is forgotten first).
    pub hello_max_tracked: usize,
    /// A connection whose hello has not arrived in this time is closed.
    pub hello_timeout: Duration,
}

impl Default for NicOptions {
    fn default() -> Self {
        NicOptions {
            hello_delay_base: Duration::from_millis(100),
            hello_delay_max: Duration::from_secs(10),
            hello_forget_after: Duration::from_secs(600),
            hello_max_tracked: 4096,
            hello_timeout: Duration::from_secs(10),
        }
    }
}

/// Refused hellos per peer IP: how long its next wrong hello waits for its answer. Pure over
/// the `now` it is given, so tests drive it with made-up instants.
#[derive(Debug)]
pub struct HelloThrottle {
    opts: NicOptions,
    /// IP -> (refusals in a row, time of the last refusal).
    peers: HashMap<IpAddr, (u32, Instant)>,
}

impl HelloThrottle {
    pub fn new(opts: NicOptions) -> Self {
        HelloThrottle {
            opts,
            peers: HashMap::new(),
        }
    }

    /// The delay the refusals in a row of `ip` have earned at `now` (nothing before any):
    /// after [`HelloThrottle::refused`], how long that refused hello waits for its answer.
    pub fn delay(&mut self, ip: IpAddr, now: Instant) -> Duration {
        let Some(&(fails, last)) = self.peers.get(&ip) else {
            return Duration::ZERO;
        };
        if now.saturating_duration_since(last) >= self.opts.hello_forget_after {
            self.peers.remove(&ip);
            return Duration::ZERO;
        }
        let shift = fails.saturating_sub(1).min(31);
        self.opts
            .hello_delay_base
            .saturating_mul(1u32 << shift)
            .min(self.opts.hello_delay_max)
    }

    /// A hello from `ip` was refused at `now`.
    pub fn refused(&mut self, ip: IpAddr, now: Instant) {
        if !self.peers.contains_key(&ip) && self.peers.len() >= self.opts.hello_max_tracked {
            let forget = self.opts.hello_forget_after;
            self.peers
                .retain(|_, (_, last)| now.saturating_duration_since(*last) < forget);
            if self.peers.len() >= self.opts.hello_max_tracked {
                if let Some(oldest) = self
                    .peers
                    .iter()
                    .min_by_key(|(_, (_, last))| *last)
                    .map(|(ip, _)| *ip)
                {
                    self.peers.remove(&oldest);
                }
            }
        }
        let e = self.peers.entry(ip).or_insert((0, now));
        e.0 = e.0.saturating_add(1);
        e.1 = now;
    }

    /// A hello from `ip` was accepted: it starts over.
    pub fn accepted(&mut self, ip: IpAddr) {
        self.peers.remove(&ip);
    }

    /// Peer IPs remembered now.
    pub fn tracked(&self) -> usize {
        self.peers.len()
    }
}

/// What every connection of one NIC shares.
#[derive(Debug)]
struct NicShared {
    region: Arc<PmRegion>,
    grants: Arc<GrantTable>,
    counters: NicCounters,
    throttle: Mutex<HelloThrottle>,
    hello_timeout: Duration,
}

/// The memory node's emulated NIC: serves one region to every connection.
#[derive(Debug)]
pub struct TcpNic {
    local_addr: SocketAddr,
    shared: Arc<NicShared>,
    task: tokio::task::JoinHandle<()>,
}

impl TcpNic {
    /// Binds `addr` and starts serving `region` under the access rules of `grants`.
    pub async fn start(
        addr: SocketAddr,
        region: Arc<PmRegion>,
        grants: Arc<GrantTable>,
    ) -> Result<Self> {
        Self::start_with(addr, region, grants, NicOptions::default()).await
    }

    /// [`TcpNic::start`] with other hello delays (tests).
    pub async fn start_with(
        addr: SocketAddr,
        region: Arc<PmRegion>,
        grants: Arc<GrantTable>,
        opts: NicOptions,
    ) -> Result<Self> {
        let listener = TcpListener::bind(addr).await.map_err(|e| {
            FabricError::Transport(format!("binding the fabric NIC to {addr}: {e}"))
        })?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| FabricError::Transport(e.to_string()))?;
        let shared = Arc::new(NicShared {
            region,
            grants,
            counters: NicCounters::default(),
            hello_timeout: opts.hello_timeout,
            throttle: Mutex::new(HelloThrottle::new(opts)),
        });
        let sh = shared.clone();
        let task = tokio::spawn(async move {
            loop {
                let (sock, peer) = match listener.accept().await {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "fabric NIC accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = sock.set_nodelay(true);
                let sh = sh.clone();
                tokio::spawn(async move {
                    match serve_conn(sock, peer, &sh).await {
                        Ok(()) => {}
                        Err(FrameError::Bad(why)) => {
                            sh.counters.bad_frames.fetch_add(1, Ordering::Relaxed);
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
            shared,
            task,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Frames refused since start (each closed its connection): export as the counter
    /// `dinomo_fabric_tcp_bad_frames_total`.
    pub fn bad_frames(&self) -> u64 {
        self.shared.counters.bad_frames.load(Ordering::Relaxed)
    }

    /// Hellos refused since start (each closed its connection and delays its IP's next
    /// hello): export as the counter `dinomo_fabric_tcp_denied_total`.
    pub fn denied(&self) -> u64 {
        self.shared.counters.denied.load(Ordering::Relaxed)
    }
}

impl Drop for TcpNic {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads and checks a connection's hello and answers it: at once when it is right, after the
/// delay its peer IP has earned by its refusals in a row when it is wrong (a tarpit: a good
/// key from the same IP, such as another KN of the host, is never slowed down).
/// `Ok(None)`: refused (answered and counted) or never sent, the connection ends.
async fn accept_hello(
    sock: &mut TcpStream,
    peer: SocketAddr,
    sh: &NicShared,
) -> std::result::Result<Option<AccessKey>, FrameError> {
    let mut hello = [0u8; HELLO_LEN];
    match tokio::time::timeout(sh.hello_timeout, sock.read_exact(&mut hello)).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(FrameError::Io(e)),
        Err(_) => {
            tracing::debug!(%peer, "fabric NIC: no hello in time, closing the connection");
            return Ok(None);
        }
    }
    let (answer, key) = match decode_hello(&hello) {
        Ok(key) => match sh.grants.check(key) {
            Ok(()) => (HELLO_OK, Some(key)),
            Err(_) => (HELLO_DENIED, None),
        },
        Err(_) => (HELLO_UNSUPPORTED, None),
    };
    let delay = {
        let mut t = sh.throttle.lock();
        match key {
            Some(_) => {
                t.accepted(peer.ip());
                Duration::ZERO
            }
            None => {
                let now = Instant::now();
                t.refused(peer.ip(), now);
                t.delay(peer.ip(), now)
            }
        }
    };
    if !delay.is_zero() {
        tokio::time::sleep(delay).await;
    }
    if key.is_none() {
        sh.counters.denied.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(
            %peer,
            answer,
            "fabric NIC: hello refused (wrong key, magic or version), closing the connection"
        );
    }
    sock.write_all(&[answer]).await.map_err(FrameError::Io)?;
    Ok(key)
}

async fn serve_conn(
    mut sock: TcpStream,
    peer: SocketAddr,
    sh: &NicShared,
) -> std::result::Result<(), FrameError> {
    let Some(key) = accept_hello(&mut sock, peer, sh).await? else {
        return Ok(());
    };
    let (region, grants) = (&*sh.region, &*sh.grants);
    let (r, w) = sock.into_split();
    let mut r = BufReader::with_capacity(256 << 10, r);
    let mut w = BufWriter::with_capacity(256 << 10, w);
    if region.is_mirrored() {
        return serve_mirrored(r, w, key, sh).await;
    }
    while let Some(frame) = read_frame(&mut r).await? {
        let (id, ops) = decode_request(frame).map_err(|e| match e {
            FabricError::Protocol(why) => FrameError::Bad(why),
            other => FrameError::Bad(other.to_string()),
        })?;
        let (mut result, barrier) = apply_post(region, grants, key, &ops);
        // A replicated memory node answers only once what the post changed (and what it read)
        // is at every backup that must acknowledge; otherwise the outcome is unknown.
        if let Some(barrier) = barrier {
            if let Err(e) = barrier.await {
                result = Err(e);
            }
        }
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

/// Checks and applies one post under its grant's hold, and takes the barrier its answer must
/// wait for (`None` when it failed). The hold spans the key and window checks and the apply,
/// so a revoke or a window close (a fence) that returns has seen every post checked against
/// the old grant applied; the barrier is taken inside it too, so a post applied before a
/// stopping memory node revoked its grants gets a barrier of the replication it stopped
/// (which fails), never one taken after the stop.
fn apply_post(
    region: &PmRegion,
    grants: &GrantTable,
    key: AccessKey,
    ops: &[Op],
) -> (
    Result<Vec<Completion>>,
    Option<crate::mirror::BarrierFuture>,
) {
    let r = grants.hold(key).and_then(|_hold| {
        exec::validate(region, ops)?;
        grants.check_window(key, ops)?;
        grants.run_post_hook(key);
        let done = exec::apply_mirrored(region, ops)?;
        Ok((done, region.mirror_barrier()))
    });
    match r {
        Ok((done, barrier)) => (Ok(done), Some(barrier)),
        Err(e) => (Err(e), None),
    }
}

/// Most bytes of posts applied on one connection of a replicated region and not yet answered
/// (their barriers pending), with what their answers carry (READs): bounds what one
/// connection adds to the backups' queues, which the node's own threads (merge, GC) wait on
/// past 64 MiB, and the answers it holds.
const MAX_UNANSWERED_BYTES: u32 = 8 << 20;
/// Most such posts (the channel between applying and answering).
const MAX_UNANSWERED: usize = 64;

/// One connection to a replicated region ([`PmRegion::is_mirrored`]): posts are applied as
/// they arrive and answered in order, each once its barrier resolved, so a connection carries
/// many posts to the backups at a time instead of one round trip each.
///
/// What a post is told stays what the inline loop tells: its barrier is taken right after it
/// applied, under its hold (so it covers its own records and every earlier one) and its answer
/// waits for it; a read is answered only after the changes it may have observed are at the
/// backups. Posts are applied in the order they arrive, as before; only their answers wait.
/// Answers written are flushed before waiting for a barrier that has not resolved, so none
/// waits behind a later post's barrier. If reading or applying fails, the posts already applied
/// are still answered before the connection closes.
async fn serve_mirrored(
    mut r: BufReader<tokio::net::tcp::OwnedReadHalf>,
    mut w: BufWriter<tokio::net::tcp::OwnedWriteHalf>,
    key: AccessKey,
    sh: &NicShared,
) -> std::result::Result<(), FrameError> {
    type Applied = (
        u64,
        Result<Vec<Completion>>,
        Option<crate::mirror::BarrierFuture>,
        tokio::sync::OwnedSemaphorePermit,
    );
    let (region, grants) = (&*sh.region, &*sh.grants);
    let (tx, mut rx) = mpsc::channel::<Applied>(MAX_UNANSWERED);
    // Permits are KiB of unanswered posts.
    let budget = Arc::new(tokio::sync::Semaphore::new(
        (MAX_UNANSWERED_BYTES >> 10) as usize,
    ));
    let apply = async move {
        while let Some(frame) = read_frame(&mut r).await? {
            let posted = frame.len() as u64;
            let (id, ops) = decode_request(frame).map_err(|e| match e {
                FabricError::Protocol(why) => FrameError::Bad(why),
                other => FrameError::Bad(other.to_string()),
            })?;
            // What the answer will hold too (READs), in KiB rounded up.
            let read: u64 = ops
                .iter()
                .map(|op| match op {
                    Op::Read { len, .. } => u64::from(*len),
                    _ => 0,
                })
                .sum();
            let kib = (posted + read)
                .div_ceil(1024)
                .clamp(1, u64::from(MAX_UNANSWERED_BYTES >> 10)) as u32;
            let Ok(permit) = budget.clone().acquire_many_owned(kib).await else {
                break;
            };
            if tx.is_closed() {
                break; // the answering side stopped: nothing applied now could be answered
            }
            let (result, barrier) = apply_post(region, grants, key, &ops);
            if tx.send((id, result, barrier, permit)).await.is_err() {
                break; // the answering side stopped: the connection is going away
            }
        }
        Ok::<(), FrameError>(())
    };
    let answer = async move {
        while let Some((id, mut result, barrier, permit)) = rx.recv().await {
            if let Some(mut barrier) = barrier {
                let polled = {
                    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
                    barrier.as_mut().poll(&mut cx)
                };
                let resolved = match polled {
                    std::task::Poll::Ready(r) => r,
                    std::task::Poll::Pending => {
                        w.flush().await.map_err(FrameError::Io)?;
                        barrier.await
                    }
                };
                if let Err(e) = resolved {
                    result = Err(e);
                }
            }
            w.write_all(&encode_response(id, &result))
                .await
                .map_err(FrameError::Io)?;
            drop(permit);
            if rx.is_empty() {
                w.flush().await.map_err(FrameError::Io)?;
            }
        }
        w.flush().await.map_err(FrameError::Io)
    };
    let (applied, answered) = tokio::join!(apply, answer);
    applied.and(answered)
}

type Waiter = oneshot::Sender<Result<Vec<Completion>>>;

/// A caller's tcp handle: one connection, many posts in flight.
#[derive(Debug)]
pub struct TcpFabric {
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
    /// Connects to the NIC at `addr` and presents `key` in the hello. Fails with
    /// [`FabricError::AccessDenied`] if the NIC refuses the key.
    pub async fn connect(addr: SocketAddr, key: AccessKey) -> Result<Self> {
        let mut sock = TcpStream::connect(addr).await.map_err(|e| {
            FabricError::Transport(format!("connecting to the fabric NIC at {addr}: {e}"))
        })?;
        let _ = sock.set_nodelay(true);
        let io = |e: std::io::Error| {
            FabricError::Transport(format!("fabric hello to the NIC at {addr}: {e}"))
        };
        sock.write_all(&encode_hello(key)).await.map_err(io)?;
        let mut answer = [0u8; 1];
        sock.read_exact(&mut answer).await.map_err(io)?;
        match answer[0] {
            HELLO_OK => {}
            HELLO_DENIED => return Err(FabricError::AccessDenied { slot: key.slot }),
            HELLO_UNSUPPORTED => {
                return Err(proto(format!(
                    "the fabric NIC at {addr} does not speak wire version {WIRE_VERSION} \
                     (run the dpm-node and KNs of one build)"
                )))
            }
            other => return Err(proto(format!("unknown hello answer {other}"))),
        }
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
        let frame = encode_request(id, ops)?;
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
        let f = encode_request(7, &ops).unwrap();
        let (id, o) = decode_request(f.slice(4..)).unwrap();
        assert_eq!((id, o), (7, ops));
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
            FabricError::OutsideWindow {
                slot: 4,
                offset: 4096,
                len: 9,
            },
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
        let ok = [Op::Read {
            offset: 0,
            len: max,
        }];
        let f = encode_request(1, &ok).unwrap();
        assert!(decode_request(f.slice(4..)).is_ok());
        let too_big = [Op::Read {
            offset: 0,
            len: max + 1,
        }];
        assert!(encode_request(1, &too_big).is_err());
    }

    #[test]
    fn encode_refuses_what_decode_would_refuse() {
        let ops = vec![Op::Faa { offset: 0, add: 1 }; MAX_OPS];
        let f = encode_request(1, &ops).unwrap();
        assert_eq!(decode_request(f.slice(4..)).unwrap().1.len(), MAX_OPS);
        let ops = vec![Op::Faa { offset: 0, add: 1 }; MAX_OPS + 1];
        assert!(encode_request(1, &ops).is_err());
        let big = [Op::Write {
            offset: 0,
            data: Bytes::from(vec![0u8; MAX_FRAME]),
        }];
        assert!(encode_request(1, &big).is_err());
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

    #[test]
    fn hello_roundtrip_and_refusals() {
        let key = AccessKey {
            slot: 5,
            generation: 7,
            secret: [9; 16],
        };
        let h = encode_hello(key);
        assert_eq!(decode_hello(&h), Ok(key));
        let mut v1 = h;
        v1[8] = 1;
        assert_eq!(decode_hello(&v1), Err(Some(1)));
        let mut other = h;
        other[0] ^= 0xff;
        assert_eq!(decode_hello(&other), Err(None));
    }

    #[test]
    fn hello_delay_doubles_caps_resets_and_forgets() {
        let opts = NicOptions {
            hello_max_tracked: 3,
            ..NicOptions::default()
        };
        let mut t = HelloThrottle::new(opts);
        let ip: IpAddr = "10.0.0.1".parse().unwrap();
        let t0 = Instant::now();
        assert_eq!(
            t.delay(ip, t0),
            Duration::ZERO,
            "no delay before any refusal"
        );
        let ms = Duration::from_millis;
        t.refused(ip, t0);
        assert_eq!(t.delay(ip, t0), ms(100));
        t.refused(ip, t0);
        assert_eq!(t.delay(ip, t0 + ms(50)), ms(200));
        for _ in 0..20 {
            t.refused(ip, t0);
        }
        assert_eq!(t.delay(ip, t0), Duration::from_secs(10), "capped at 10 s");
        // Almost ten quiet minutes: still remembered; ten: forgotten.
        assert_eq!(
            t.delay(ip, t0 + Duration::from_secs(599)),
            Duration::from_secs(10)
        );
        assert_eq!(t.delay(ip, t0 + Duration::from_secs(600)), Duration::ZERO);
        assert_eq!(t.tracked(), 0);
        // A success resets.
        t.refused(ip, t0);
        t.accepted(ip);
        assert_eq!(t.delay(ip, t0), Duration::ZERO);
        // At most 3 IPs: the one refused longest ago goes first.
        for (i, d) in [(1u8, 0u64), (2, 1), (3, 2), (4, 3)] {
            t.refused(IpAddr::from([10, 0, 0, i]), t0 + ms(d));
        }
        assert_eq!(t.tracked(), 3);
        let first = IpAddr::from([10, 0, 0, 1]);
        assert_eq!(t.delay(first, t0), Duration::ZERO, "evicted");
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
