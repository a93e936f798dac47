//! The caller's side: [`VerbsFabric`], one RC queue pair to the node's region, a registered
//! local bounce buffer, the still-open side channel (the node sees the caller go away when it
//! closes), and the memory regions of its write window as the node last announced them.
//!
//! Invariants:
//! - Bounds and alignment are checked against the region length the node announced, and every
//!   WRITE, CAS and FAA against the window regions the caller knows, before anything is posted,
//!   so a refused post applies nothing. A post with an operation no known region covers asks
//!   the node once (WINDOW) and is refused whole with [`FabricError::OutsideWindow`] if the
//!   answer does not cover it either. One ask is enough: the node answers from the grant
//!   table, and the DPM opens a segment there before AllocateSegment answers.
//! - Each work request names the rkey of the region that covers it: READ the READ region,
//!   WRITE (and its durability READ) and atomics their window region.
//! - One post = one doorbell: all of its work requests go to `ibv_post_send` as one linked list
//!   (a post with more than [`MAX_WR_PER_DOORBELL`] requests is rung in several doorbells, one
//!   after the other). Every request is signaled and the post waits for all of them once.
//! - A WRITE is followed, in the same post, by a 1-byte READ of its last byte through the same
//!   region (RC executes requests in order at the responder, so the READ's response implies the
//!   WRITE's data was placed). The extra READ is not counted in the stats.
//! - Posts on one handle are executed one at a time (in arrival order), each in a
//!   `spawn_blocking` thread, never on a runtime worker: the completion queue is polled and the
//!   side channel spoken there. The bounce buffer, the QP and the side channel belong to that
//!   post until it is over, even if the caller's future is dropped, so the device never writes
//!   into memory that was freed or reused and no request is abandoned half-way.
//! - The device refusing a request (remote access error: its region was deregistered) leaves
//!   both QPs in the error state. The handle restarts them over the side channel (RESTART),
//!   which also tells it whether its key is still valid and what its window is now: a revoked
//!   key breaks the handle for good ([`FabricError::AccessDenied`]); otherwise the post fails
//!   (see the module doc, "Write windows") and the handle goes on. Any other failed work
//!   request breaks the handle ([`FabricError::Transport`]); a caller reconnects with a new one.

use std::fmt;
use std::net::SocketAddr;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use sideway::ibverbs::completion::WorkCompletionStatus;
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    PostSendGuard, QueuePair, SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;
use tokio::net::TcpStream;

use super::device::{Device, QpParts};
use super::side::{
    check_magic, get_status, get_window, need, put_hello, read_msg, write_msg, Endpoint,
    SideChannel, WindowMr, REQ_RESTART, REQ_WINDOW,
};
use super::{chain, transport, verbs_err, MAX_WR_PER_DOORBELL, POST_TIMEOUT};
use crate::error::{FabricError, Result};
use crate::grants::WindowAccess;
use crate::op::{AccessKey, Completion, Op};
use crate::stats::FabricStats;
use crate::Fabric;

/// Work requests that are the hidden durability READ carry this bit in their wr_id.
const FLUSH_BIT: u64 = 1 << 63;

/// A page-aligned heap buffer the device reads from and writes into.
struct LocalBuf {
    ptr: NonNull<u8>,
    layout: std::alloc::Layout,
}

// SAFETY: plain memory owned by this struct; it is only touched by the thread holding the
// connection lock (and by the device while a post that owns the lock is in flight).
unsafe impl Send for LocalBuf {}
unsafe impl Sync for LocalBuf {}

impl LocalBuf {
    fn new(len: usize) -> Result<Self> {
        let layout = std::alloc::Layout::from_size_align(len, 4096)
            .map_err(|e| FabricError::Config(format!("bounce buffer of {len} bytes: {e}")))?;
        // SAFETY: non-zero size (callers ask for at least a page).
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            NonNull::new(p).ok_or_else(|| transport(format!("cannot allocate {len} bytes")))?;
        Ok(LocalBuf { ptr, layout })
    }

    fn len(&self) -> usize {
        self.layout.size()
    }
}

impl Drop for LocalBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new() with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

/// The registered bounce buffer.
struct Bounce {
    // Field order is drop order: deregister before freeing.
    mr: Arc<MemoryRegion>,
    buf: LocalBuf,
}

impl Bounce {
    fn new(pd: &Arc<ProtectionDomain>, len: usize) -> Result<Self> {
        let buf = LocalBuf::new(len)?;
        // SAFETY: the buffer outlives the MR (field order above).
        let mr = unsafe {
            pd.reg_mr(
                buf.ptr.as_ptr() as usize,
                buf.len(),
                AccessFlags::LocalWrite,
            )
        }
        .map_err(|e| verbs_err("registering the bounce buffer")(&e))?;
        Ok(Bounce { mr, buf })
    }

    fn addr(&self, at: usize) -> u64 {
        self.buf.ptr.as_ptr() as u64 + at as u64
    }
}

/// What the caller learnt about the node's region at the handshake.
#[derive(Debug, Clone, Copy)]
struct Remote {
    /// The READ region's rkey (the whole region, READ only).
    read_rkey: u32,
    base: u64,
    len: u64,
}

/// Why a handle no longer works.
#[derive(Debug, Clone)]
enum Broken {
    Denied(u32),
    Transport(String),
}

impl Broken {
    fn of(e: &FabricError) -> Self {
        match e {
            FabricError::AccessDenied { slot } => Broken::Denied(*slot),
            other => Broken::Transport(other.to_string()),
        }
    }

    fn error(&self) -> FabricError {
        match self {
            Broken::Denied(slot) => FabricError::AccessDenied { slot: *slot },
            Broken::Transport(m) => FabricError::Transport(m.clone()),
        }
    }
}

/// The caller's QP, buffers and side channel; owned by one post at a time.
struct Conn {
    // Field order is drop order: the QP (which may still reference the bounce buffer) first.
    parts: QpParts,
    bounce: Bounce,
    dev: Device,
    remote: Remote,
    slot: u32,
    /// The regions of the write window the node last announced.
    window: Vec<WindowMr>,
    /// `None` only before the handshake has finished.
    side: Option<SideChannel>,
    broken: Option<Broken>,
    /// How many times the device refused a request and the QPs were restarted.
    restarts: Arc<AtomicU64>,
}

/// What one work request does.
#[derive(Clone, Copy, Debug)]
enum WrKind {
    Read {
        len: u32,
    },
    Write {
        len: u32,
    },
    /// The 1-byte durability READ after a WRITE (into the scratch word at 0).
    Flush,
    Cas {
        expected: u64,
        new: u64,
    },
    Faa {
        add: u64,
    },
}

/// One work request: its operation, where its local bytes live in the bounce buffer, and the
/// remote address and rkey it targets.
#[derive(Clone, Copy, Debug)]
struct Wr {
    op: usize,
    kind: WrKind,
    at: usize,
    remote: u64,
    rkey: u32,
}

/// Why a doorbell's requests failed.
enum RingError {
    /// The device refused request `n` of the doorbell (remote access error).
    Refused(usize),
    Failed(FabricError),
}

fn align8(n: usize) -> usize {
    (n + 7) & !7
}

/// The bytes a WRITE, CAS or FAA changes: (offset, len, whether an atomic-only range may hold
/// it). `None` for READ.
fn extent(op: &Op) -> Option<(u64, u64, bool)> {
    match op {
        Op::Read { .. } => None,
        Op::Write { offset, data } => Some((*offset, data.len() as u64, false)),
        Op::Cas { offset, .. } => Some((*offset, 8, true)),
        Op::Faa { offset, .. } => Some((*offset, 8, false)),
    }
}

impl Conn {
    fn create(device: Option<&str>) -> Result<(Self, Endpoint)> {
        let dev = Device::open(device)?;
        let parts = dev.new_qp(MAX_WR_PER_DOORBELL, false)?;
        let bounce = Bounce::new(&parts.pd, 64 << 10)?;
        let ep = dev.endpoint(&parts, dev.max_init_rd_atomic);
        let conn = Conn {
            parts,
            bounce,
            dev,
            remote: Remote {
                read_rkey: 0,
                base: 0,
                len: 0,
            },
            slot: 0,
            window: Vec::new(),
            side: None,
            broken: None,
            restarts: Arc::new(AtomicU64::new(0)),
        };
        Ok((conn, ep))
    }

    /// The rkey of the region through which `op` may be posted, if the caller knows one.
    fn rkey_for(&self, op: &Op) -> Option<u32> {
        let Some((offset, len, atomic_ok)) = extent(op) else {
            return Some(self.remote.read_rkey);
        };
        let end = offset.checked_add(len)?;
        self.window
            .iter()
            .find(|w| {
                w.range.offset <= offset
                    && end <= w.range.offset.saturating_add(w.range.len)
                    && (w.range.access == WindowAccess::Write || atomic_ok)
            })
            .map(|w| w.rkey)
    }

    /// The first WRITE, CAS or FAA of `ops` no known region covers, as (offset, len).
    fn uncovered(&self, ops: &[Op]) -> Option<(u64, u64)> {
        ops.iter()
            .find(|op| self.rkey_for(op).is_none())
            .and_then(extent)
            .map(|(offset, len, _)| (offset, len))
    }

    fn side(&mut self) -> Result<&mut SideChannel> {
        self.side
            .as_mut()
            .ok_or_else(|| transport("the verbs side channel is not open"))
    }

    /// Asks the node for the regions of the current window (WINDOW). Any failure breaks the
    /// handle: the node closes the channel after a refusal.
    fn refresh_window(&mut self) -> Result<()> {
        let r = self
            .side()
            .and_then(|s| s.ask(&[REQ_WINDOW]))
            .and_then(|mut b| {
                get_status(&mut b, "a window request")?;
                get_window(&mut b)
            });
        match r {
            Ok(w) => {
                self.window = w;
                Ok(())
            }
            Err(e) => {
                self.broken = Some(Broken::of(&e));
                Err(e)
            }
        }
    }

    /// Restarts both QPs after the device refused a request (RESTART), and takes the window
    /// the node answers with.
    fn restart(&mut self) -> Result<()> {
        self.dev.restart_qp(&mut self.parts)?;
        let mut req = BytesMut::new();
        req.put_u8(REQ_RESTART);
        self.dev
            .endpoint(&self.parts, self.dev.max_init_rd_atomic)
            .put(&mut req);
        let mut b = self.side()?.ask(&req)?;
        get_status(&mut b, "restarting the queue pair")?;
        let peer = Endpoint::get(&mut b)?;
        let window = get_window(&mut b)?;
        let init_rd = self.dev.max_init_rd_atomic.min(peer.rd_atomic.max(1));
        let dest_rd = self.dev.max_rd_atomic;
        let dev = &self.dev;
        dev.connect_qp(&mut self.parts, &peer, dest_rd, init_rd)?;
        self.window = window;
        Ok(())
    }

    /// The error of a post whose request `n` the device refused, after restarting the QPs.
    fn refused(&mut self, ops: &[Op], wrs: &[Wr], n: usize) -> FabricError {
        self.restarts.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = self.restart() {
            tracing::debug!(slot = self.slot, error = %e, "verbs restart after a refused request failed");
            self.broken = Some(Broken::of(&e));
            return e;
        }
        let wr = wrs[n];
        let op = &ops[wr.op];
        let Some((offset, len, _)) = extent(op) else {
            return transport(format!(
                "the device refused a {} although the key is valid",
                describe(&wr)
            ));
        };
        if self.rkey_for(op).is_some() {
            return transport(format!(
                "the device refused a {} inside the write window",
                describe(&wr)
            ));
        }
        // The range left the window under the post. If the refused request is the WRITE or
        // atomic itself (not the durability READ after a WRITE that was placed) and nothing
        // before it in the post changed memory, nothing was applied: the same refusal as a
        // local one. Otherwise some of the post may be in place.
        let first_change = wrs[..n]
            .iter()
            .all(|w| matches!(w.kind, WrKind::Read { .. }));
        if first_change && !matches!(wr.kind, WrKind::Flush) {
            FabricError::OutsideWindow {
                slot: self.slot,
                offset,
                len,
            }
        } else {
            FabricError::WindowClosedDuringPost {
                slot: self.slot,
                offset,
                len,
            }
        }
    }

    /// Plans the work requests of `ops` (every one covered by a known region) and their places
    /// in the bounce buffer.
    fn plan(&self, ops: &[Op]) -> Result<(Vec<Wr>, usize)> {
        // Offset 0..8 is the scratch the durability READs land in.
        let mut at = 8usize;
        let mut wrs = Vec::with_capacity(ops.len() * 2);
        for (i, op) in ops.iter().enumerate() {
            let remote = self.remote.base + op.offset();
            let rkey = self
                .rkey_for(op)
                .ok_or_else(|| transport("planned an operation outside the window"))?;
            let mut push = |kind, at| {
                wrs.push(Wr {
                    op: i,
                    kind,
                    at,
                    remote,
                    rkey,
                })
            };
            match op {
                Op::Read { len, .. } => {
                    if *len > 0 {
                        push(WrKind::Read { len: *len }, at);
                        at += align8(*len as usize);
                    }
                }
                Op::Write { data, .. } => {
                    if !data.is_empty() {
                        let len = data.len() as u32;
                        push(WrKind::Write { len }, at);
                        wrs.push(Wr {
                            op: i,
                            kind: WrKind::Flush,
                            at: 0,
                            remote: remote + u64::from(len) - 1,
                            rkey,
                        });
                        at += align8(data.len());
                    }
                }
                Op::Cas { expected, new, .. } => {
                    push(
                        WrKind::Cas {
                            expected: *expected,
                            new: *new,
                        },
                        at,
                    );
                    at += 8;
                }
                Op::Faa { add, .. } => {
                    push(WrKind::Faa { add: *add }, at);
                    at += 8;
                }
            }
        }
        Ok((wrs, at))
    }

    /// Runs one post on the calling (blocking) thread.
    fn execute(&mut self, ops: &[Op]) -> Result<Vec<Completion>> {
        if let Some(b) = &self.broken {
            return Err(b.error());
        }
        if self.uncovered(ops).is_some() {
            self.refresh_window()?;
            if let Some((offset, len)) = self.uncovered(ops) {
                return Err(FabricError::OutsideWindow {
                    slot: self.slot,
                    offset,
                    len,
                });
            }
        }
        let (wrs, need) = self.plan(ops)?;
        if need > self.bounce.buf.len() {
            let len = need.next_power_of_two().max(1 << 20);
            self.bounce = Bounce::new(&self.parts.pd, len)?;
        }
        // Stage the WRITE payloads.
        for wr in &wrs {
            if let (WrKind::Write { len }, Op::Write { data, .. }) = (wr.kind, &ops[wr.op]) {
                // SAFETY: `at + len <= need <= bounce length`; no request is in flight.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        data.as_ptr(),
                        self.bounce.buf.ptr.as_ptr().add(wr.at),
                        len as usize,
                    )
                };
            }
        }
        for (c, chunk) in wrs.chunks(MAX_WR_PER_DOORBELL).enumerate() {
            match self.ring(chunk) {
                Ok(()) => {}
                Err(RingError::Refused(n)) => {
                    return Err(self.refused(ops, &wrs, c * MAX_WR_PER_DOORBELL + n));
                }
                Err(RingError::Failed(e)) => {
                    self.broken = Some(Broken::of(&e));
                    return Err(e);
                }
            }
        }
        let base = self.bounce.buf.ptr.as_ptr();
        let mut out: Vec<Completion> = ops
            .iter()
            .map(|op| match op {
                Op::Read { .. } => Completion::Read(Bytes::new()),
                Op::Write { .. } => Completion::Written,
                Op::Cas { .. } => Completion::Cas { old: 0 },
                Op::Faa { .. } => Completion::Faa { old: 0 },
            })
            .collect();
        let word = |at: usize| {
            let mut w = [0u8; 8];
            // SAFETY: in the buffer, every completion has arrived.
            unsafe { std::ptr::copy_nonoverlapping(base.add(at), w.as_mut_ptr(), 8) };
            u64::from_ne_bytes(w)
        };
        for wr in &wrs {
            match wr.kind {
                WrKind::Read { len } => {
                    // SAFETY: in the buffer, the READ has completed.
                    let s = unsafe { std::slice::from_raw_parts(base.add(wr.at), len as usize) };
                    out[wr.op] = Completion::Read(Bytes::copy_from_slice(s));
                }
                WrKind::Cas { .. } => out[wr.op] = Completion::Cas { old: word(wr.at) },
                WrKind::Faa { .. } => out[wr.op] = Completion::Faa { old: word(wr.at) },
                WrKind::Write { .. } | WrKind::Flush => {}
            }
        }
        Ok(out)
    }

    /// Posts `wrs` with one doorbell and waits for every completion.
    fn ring(&mut self, wrs: &[Wr]) -> std::result::Result<(), RingError> {
        let lkey = self.bounce.mr.lkey();
        let addr = |at| self.bounce.addr(at);
        let mut guard = self.parts.qp.start_post_send();
        for (n, wr) in wrs.iter().enumerate() {
            let flush = if matches!(wr.kind, WrKind::Flush) {
                FLUSH_BIT
            } else {
                0
            };
            let h = guard.construct_wr(n as u64 | flush, WorkRequestFlags::Signaled);
            let (rkey, remote, at) = (wr.rkey, wr.remote, wr.at);
            // SAFETY: every local range lies in the registered bounce buffer, which this post
            // owns until its completions are polled below.
            unsafe {
                match wr.kind {
                    WrKind::Read { len } => {
                        h.setup_read(rkey, remote).setup_sge(lkey, addr(at), len)
                    }
                    WrKind::Write { len } => {
                        h.setup_write(rkey, remote).setup_sge(lkey, addr(at), len)
                    }
                    WrKind::Flush => h.setup_read(rkey, remote).setup_sge(lkey, addr(at), 1),
                    WrKind::Cas { expected, new } => h
                        .setup_atomic_compare_swap(rkey, remote, expected, new)
                        .setup_sge(lkey, addr(at), 8),
                    WrKind::Faa { add } => {
                        h.setup_atomic_fetch_add(rkey, remote, add)
                            .setup_sge(lkey, addr(at), 8)
                    }
                }
            }
        }
        guard
            .post()
            .map_err(|e| RingError::Failed(transport(format!("ibv_post_send: {}", chain(&e)))))?;

        let mut pending = wrs.len();
        let mut first_err: Option<(usize, u32, u32)> = None;
        let start = Instant::now();
        let mut idle = 0u32;
        while pending > 0 {
            let mut got = 0;
            if let Ok(poller) = self.parts.cq.start_poll() {
                for wc in poller {
                    got += 1;
                    let status = wc.status();
                    if status != WorkCompletionStatus::Success as u32 {
                        let n = (wc.wr_id() & !FLUSH_BIT) as usize;
                        // Flushed requests (after the first failure) are not the cause.
                        let flushed =
                            status == WorkCompletionStatus::WorkRequestFlushedError as u32;
                        if first_err.is_none_or(|(_, s, _)| {
                            s == WorkCompletionStatus::WorkRequestFlushedError as u32 && !flushed
                        }) {
                            first_err = Some((n, status, wc.vendor_err()));
                        }
                    }
                }
            }
            pending = pending.saturating_sub(got);
            if pending == 0 {
                break;
            }
            if got > 0 {
                idle = 0;
                continue;
            }
            idle += 1;
            if start.elapsed() > POST_TIMEOUT {
                return Err(RingError::Failed(transport(format!(
                    "{pending} of {} work requests did not complete within {POST_TIMEOUT:?}",
                    wrs.len()
                ))));
            }
            // Spin briefly (completions usually come within microseconds), then back off so the
            // device's kernel work (Soft-RoCE) gets the CPU.
            if idle < 200 {
                std::hint::spin_loop();
            } else if idle < 400 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(Duration::from_micros(50));
            }
        }
        if let Some((n, status, vendor)) = first_err {
            let what = wrs.get(n).map_or_else(|| "?".to_string(), describe);
            if status == WorkCompletionStatus::RemoteAccessError as u32 && n < wrs.len() {
                tracing::debug!(slot = self.slot, %what, "remote access error: the region was deregistered");
                return Err(RingError::Refused(n));
            }
            return Err(RingError::Failed(transport(format!(
                "{what} failed on {}: {} (status {status}, vendor error {vendor:#x})",
                self.dev.name,
                status_name(status)
            ))));
        }
        Ok(())
    }
}

fn describe(wr: &Wr) -> String {
    let op = wr.op;
    match wr.kind {
        WrKind::Read { len } => format!("READ of {len} bytes (operation {op})"),
        WrKind::Write { len } => format!("WRITE of {len} bytes (operation {op})"),
        WrKind::Flush => format!("durability READ after the WRITE (operation {op})"),
        WrKind::Cas { .. } => format!("CAS (operation {op})"),
        WrKind::Faa { .. } => format!("FAA (operation {op})"),
    }
}

fn status_name(status: u32) -> String {
    use WorkCompletionStatus as S;
    const KNOWN: [S; 12] = [
        S::Success,
        S::LocalLengthError,
        S::LocalQueuePairOperationError,
        S::LocalProtectionError,
        S::WorkRequestFlushedError,
        S::BadResponseError,
        S::LocalAccessError,
        S::RemoteInvalidRequestError,
        S::RemoteAccessError,
        S::RemoteOperationError,
        S::RetryCounterExceededError,
        S::GeneralError,
    ];
    KNOWN
        .iter()
        .find(|s| **s as u32 == status)
        .map_or_else(|| format!("status {status}"), |s| format!("{s:?}"))
}

/// Checks every operation against the announced region, before anything is posted.
fn validate(region_len: u64, ops: &[Op]) -> Result<()> {
    let check = |offset: u64, len: u64| match offset.checked_add(len) {
        Some(end) if end <= region_len => Ok(()),
        _ => Err(FabricError::OutOfBounds {
            offset,
            len,
            region_len,
        }),
    };
    for op in ops {
        match op {
            Op::Read { offset, len } => check(*offset, u64::from(*len))?,
            Op::Write { offset, data } => {
                check(*offset, data.len() as u64)?;
                if u32::try_from(data.len()).is_err() {
                    return Err(FabricError::Config(
                        "a WRITE larger than 4 GiB cannot be posted".into(),
                    ));
                }
            }
            Op::Cas { offset, .. } | Op::Faa { offset, .. } => {
                check(*offset, 8)?;
                if offset % 8 != 0 {
                    return Err(FabricError::Misaligned { offset: *offset });
                }
            }
        }
    }
    Ok(())
}

/// A caller's verbs handle: one RC queue pair to the node's region.
pub struct VerbsFabric {
    conn: Arc<tokio::sync::Mutex<Conn>>,
    region_len: u64,
    key: AccessKey,
    device: String,
    stats: FabricStats,
    restarts: Arc<AtomicU64>,
}

impl fmt::Debug for VerbsFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsFabric")
            .field("slot", &self.key.slot)
            .field("device", &self.device)
            .field("region_len", &self.region_len)
            .finish()
    }
}

impl VerbsFabric {
    /// Connects to the [`super::VerbsNic`] whose side channel listens on `addr`, presenting
    /// `key`, through the local RDMA device `DINOMO_RDMA_DEVICE` (else the first one). Fails
    /// with [`FabricError::AccessDenied`] if the node does not accept the key.
    pub async fn connect(addr: SocketAddr, key: AccessKey) -> Result<Self> {
        Self::connect_on(None, addr, key).await
    }

    /// [`VerbsFabric::connect`] through the local RDMA device named `device` (`None`:
    /// `DINOMO_RDMA_DEVICE`, else the first).
    pub async fn connect_on(
        device: Option<&str>,
        addr: SocketAddr,
        key: AccessKey,
    ) -> Result<Self> {
        let mut sock = TcpStream::connect(addr).await.map_err(|e| {
            transport(format!(
                "connecting to the verbs side channel at {addr}: {e}"
            ))
        })?;
        let _ = sock.set_nodelay(true);
        let device = device.map(str::to_string);
        let (mut conn, local) =
            tokio::task::spawn_blocking(move || Conn::create(device.as_deref()))
                .await
                .map_err(|e| transport(format!("creating the queue pair: {e}")))??;

        let mut hello = BytesMut::new();
        put_hello(&mut hello, key, &local);
        write_msg(&mut sock, &hello).await?;

        let mut r = read_msg(&mut sock).await?;
        check_magic(&mut r)?;
        get_status(&mut r, &format!("the connection at {addr}"))?;
        let peer = Endpoint::get(&mut r)?;
        need(&r, 4 + 8 + 8)?;
        let remote = Remote {
            read_rkey: r.get_u32_le(),
            base: r.get_u64_le(),
            len: r.get_u64_le(),
        };
        conn.remote = remote;
        conn.slot = key.slot;
        let init_rd = conn.dev.max_init_rd_atomic.min(peer.rd_atomic.max(1));
        let dest_rd = conn.dev.max_rd_atomic;
        let dev = &conn.dev;
        dev.connect_qp(&mut conn.parts, &peer, dest_rd, init_rd)?;
        conn.side = Some(SideChannel::new(sock)?);
        let device = conn.dev.name.clone();
        let restarts = conn.restarts.clone();
        tracing::debug!(%addr, slot = key.slot, device = %device, region_len = remote.len, "verbs fabric connected");
        Ok(VerbsFabric {
            conn: Arc::new(tokio::sync::Mutex::new(conn)),
            region_len: remote.len,
            key,
            device,
            stats: FabricStats::default(),
            restarts,
        })
    }

    /// The length of the node's region.
    pub fn region_len(&self) -> u64 {
        self.region_len
    }

    /// How many times the device refused one of this handle's requests (a region deregistered
    /// under it: a closed window range, or a revoked key) and its queue pairs were restarted.
    /// A refusal the caller made itself, before posting, does not count.
    pub fn device_refusals(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }
}

#[async_trait]
impl Fabric for VerbsFabric {
    async fn post(&self, ops: &[Op]) -> Result<Vec<Completion>> {
        self.stats.record_post(ops);
        validate(self.region_len, ops)?;
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.conn.clone().lock_owned().await;
        let ops = ops.to_vec();
        // The blocking task owns the connection until every completion is in and any side
        // channel request is answered, even if this future is dropped meanwhile.
        tokio::task::spawn_blocking(move || conn.execute(&ops))
            .await
            .map_err(|e| transport(format!("verbs post task failed: {e}")))?
    }

    fn stats(&self) -> &FabricStats {
        &self.stats
    }

    fn backend(&self) -> &'static str {
        "verbs"
    }
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validation_matches_the_other_backends() {
        let len = 1 << 20;
        assert!(validate(
            len,
            &[Op::Read {
                offset: len - 8,
                len: 8
            }]
        )
        .is_ok());
        assert!(matches!(
            validate(
                len,
                &[Op::Read {
                    offset: len - 4,
                    len: 8
                }]
            ),
            Err(FabricError::OutOfBounds { .. })
        ));
        assert!(matches!(
            validate(
                len,
                &[Op::Cas {
                    offset: 3,
                    expected: 0,
                    new: 1
                }]
            ),
            Err(FabricError::Misaligned { offset: 3 })
        ));
        assert!(matches!(
            validate(
                len,
                &[Op::Faa {
                    offset: len,
                    add: 1
                }]
            ),
            Err(FabricError::OutOfBounds { .. })
        ));
        assert!(matches!(
            validate(
                len,
                &[Op::Write {
                    offset: u64::MAX,
                    data: Bytes::from_static(b"x")
                }]
            ),
            Err(FabricError::OutOfBounds { .. })
        ));
    }

    /// Returns false (printing why) outside the VM when there is no RDMA device; inside it
    /// (`DINOMO_VM=1`) a missing device fails.
    fn rdma_present() -> bool {
        if !super::super::device_names().is_empty() {
            return true;
        }
        assert!(
            !std::env::var("DINOMO_VM").is_ok_and(|v| v == "1"),
            "DINOMO_VM=1 but there is no RDMA device"
        );
        println!("SKIPPED: no RDMA device (not in the test VM; scripts/vm-tests.sh runs this)");
        false
    }

    /// The device, not only the caller's check, enforces the window: a caller that lies to
    /// itself about its regions (as a caller bypassing this crate could) gets its WRITEs and
    /// atomics outside the window refused by the device, with the bytes unchanged. The one
    /// thing the device cannot refuse is an FAA through the cell space's atomic region.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_device_refuses_what_the_regions_do_not_cover() {
        use crate::grants::{GrantTable, WindowRange};
        use crate::pm::{DurabilityRequest, PmRegion};
        use crate::FabricExt;

        if !rdma_present() {
            return;
        }
        const LEN: u64 = 8 << 20;
        const SEG: u64 = 3 << 20;
        const CELLS: u64 = 4 << 20;
        const INDEX: u64 = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        let pool = dir.path().join("pool");
        let region = Arc::new(PmRegion::create(&pool, LEN, DurabilityRequest::Auto).unwrap());
        let grants = Arc::new(GrantTable::create(&GrantTable::path_for(&pool), 4).unwrap());
        let nic = super::super::VerbsNic::start(
            "127.0.0.1:0".parse().unwrap(),
            region.clone(),
            grants.clone(),
        )
        .await
        .unwrap();
        let key = grants
            .grant_with_window(&[
                WindowRange::write(SEG, 64 << 10),
                WindowRange::atomic(CELLS, 4096),
            ])
            .unwrap();
        let f = VerbsFabric::connect(nic.local_addr(), key).await.unwrap();
        f.write(SEG, Bytes::from_static(b"learns the window"))
            .await
            .unwrap();
        let local = |offset: u64, len: usize| {
            let mut v = vec![0; len];
            region.read(offset, &mut v).unwrap();
            v
        };
        // Lies the caller tells itself: (what it claims, the region whose rkey it uses).
        let (seg_rkey, cells_rkey, read_rkey) = {
            let c = f.conn.lock().await;
            let rkey = |at: u64| {
                c.window
                    .iter()
                    .find(|w| w.range.offset == at)
                    .map(|w| w.rkey)
                    .unwrap()
            };
            (rkey(SEG), rkey(CELLS), c.remote.read_rkey)
        };
        let lie = |rkey: u32| WindowMr {
            range: WindowRange::write(0, LEN),
            rkey,
        };
        let cases: [(&str, u32, Op); 5] = [
            (
                "a WRITE of the superblock through the segment's region",
                seg_rkey,
                Op::Write {
                    offset: 0,
                    data: Bytes::from_static(&[0xee; 64]),
                },
            ),
            (
                "a WRITE past the segment's end through its region",
                seg_rkey,
                Op::Write {
                    offset: SEG + (64 << 10) - 8,
                    data: Bytes::from_static(&[0xee; 16]),
                },
            ),
            (
                "a WRITE of a cell through the cell space's (atomic) region",
                cells_rkey,
                Op::Write {
                    offset: CELLS,
                    data: Bytes::from_static(&[0xee; 8]),
                },
            ),
            (
                "a WRITE of the index through the READ region",
                read_rkey,
                Op::Write {
                    offset: INDEX,
                    data: Bytes::from_static(&[0xee; 64]),
                },
            ),
            (
                "a CAS of the index through the READ region",
                read_rkey,
                Op::Cas {
                    offset: INDEX,
                    expected: 0,
                    new: 1,
                },
            ),
        ];
        for (n, (what, rkey, op)) in cases.into_iter().enumerate() {
            f.conn.lock().await.window = vec![lie(rkey)];
            let (offset, len, _) = extent(&op).unwrap();
            let before = local(offset, len as usize);
            let r = f.post(std::slice::from_ref(&op)).await;
            assert!(
                matches!(r, Err(FabricError::OutsideWindow { .. })),
                "{what}: {r:?}"
            );
            assert_eq!(local(offset, len as usize), before, "{what}: bytes changed");
            assert_eq!(
                f.device_refusals(),
                n as u64 + 1,
                "{what}: not refused by the device"
            );
            // The restart brought the true window back: the handle works.
            f.write(SEG + 64, Bytes::from_static(b"still works"))
                .await
                .unwrap_or_else(|e| panic!("after {what}: {e}"));
        }
        // The weakness: the atomic region cannot tell FAA from CAS, so an FAA in the cell
        // space through it lands; only the caller's check refuses it.
        let refusals = f.device_refusals();
        assert!(matches!(
            f.faa(CELLS + 8, 1).await,
            Err(FabricError::OutsideWindow { .. })
        ));
        f.conn.lock().await.window = vec![WindowMr {
            range: WindowRange::write(CELLS, 4096),
            rkey: cells_rkey,
        }];
        assert_eq!(f.faa(CELLS + 8, 1).await.unwrap(), 0);
        assert_eq!(local(CELLS + 8, 8), 1u64.to_le_bytes());
        assert_eq!(f.device_refusals(), refusals);
        drop(f);
        drop(nic);
    }
}
