//! The verbs backend: real one-sided RDMA over RC queue pairs (rdma-core through the `sideway`
//! crate), behind cargo feature `rdma`. Tested for real on Soft-RoCE (`rxe0`) inside the VM of
//! `scripts/vm-tests.sh`; see docs/decisions/0001-rdma-binding.md for why sideway.
//!
//! What it owns:
//! - [`VerbsNic`], the memory-node side. It opens the RDMA device once and listens on a TCP
//!   *side channel* (a small handshake, not the data path). For every caller that connects it
//!   checks the presented [`AccessKey`] against the [`GrantTable`], then creates a protection
//!   domain, a completion queue and an RC queue pair for that caller alone, registers the whole
//!   region as a memory region (MR) in that domain, and answers with its QP number, GID and the
//!   MR's rkey. After that the node's CPU does nothing for the caller: READ, WRITE, CAS and FAA
//!   are executed by the RDMA device. [`VerbsNic::revoke`] revokes the key in the grant table and
//!   deregisters that caller's MR, so its later operations fail at the device with a remote
//!   access error; a watcher also deregisters the MR of any connected key that was revoked in
//!   the grant table by someone else (within [`REVOKE_POLL`]). Closing the side channel ends
//!   the connection and frees its QP and MR.
//!
//!   Fencing: only [`VerbsNic::revoke`] is a fence for verbs callers. Deregistering an MR
//!   returns once the device no longer places data through it, so when `revoke` returns every
//!   operation of the caller either was placed before (a merge after the fence sees it) or
//!   fails with a remote access error; a WRITE placed just before the deregistration whose
//!   trailing READ is refused is reported as an error, never as done. A revoke made directly
//!   in the [`GrantTable`] (what the DPM's FenceKn does) is *not* a fence here: until the
//!   watcher notices it (up to [`REVOKE_POLL`] later) the caller's WRITEs still land and
//!   complete successfully, and a caller whose key passed the handshake's check just
//!   before such a revoke gets a live MR the same way. Whoever fences verbs callers must call
//!   [`VerbsNic::revoke`], or the same through [`KeyFence`]: the dpm-node installs its NIC as
//!   the DPM's key fence, so FenceKn and a KN's re-registration deregister the old key's MRs
//!   before they go on to merge.
//!
//!   Write windows (see grants.rs) are not enforced on verbs yet: the MR grants REMOTE_WRITE
//!   and REMOTE_ATOMIC over the whole region, as before windows existed, so a verbs caller's
//!   WRITE outside its window lands. The design (docs/decisions/0005-security.md, Decision 5)
//!   gives each connection a read-only pool MR, an atomic MR over the cell space, and one
//!   write MR per window segment, registered on request and deregistered when the segment
//!   leaves the window.
//! - [`VerbsFabric`], the caller side: one RC QP, a registered local bounce buffer, and the
//!   still-open side channel (the node sees the caller go away when it closes).
//!
//! Side-channel handshake (little-endian, every message `[u32 body length][body]`):
//! - hello (caller to node): `u64 magic "DNMVERBS", u16 version (2), u32 slot, u32 generation,
//!   [u8; 16] secret`, endpoint (version 1 had a `u64 token` instead of generation and secret);
//! - reply: `u64 magic, u8 status`; status 0: endpoint, `u32 rkey, u64 remote base, u64 region
//!   length`; 1 (access denied): `u32 slot`; 2 (node error): `u16 len, message`.
//! - endpoint: `u32 qpn, u32 psn, u16 lid, [u8; 16] gid, u8 mtu (ibv_mtu), u8 rd_atomic`.
//!
//! Invariants:
//! - Each connection has its own protection domain, so an rkey is usable only through the QP it
//!   was handed to: a fenced caller cannot borrow another caller's rkey.
//! - Bounds and alignment are checked on the caller's side against the region length the node
//!   announced, before anything is posted, so a bad post applies nothing.
//! - One post = one doorbell: all of its work requests go to `ibv_post_send` as one linked list
//!   (a post with more than [`MAX_WR_PER_DOORBELL`] requests is rung in several doorbells, one
//!   after the other). Every request is signaled and the post waits for all of them once.
//! - A WRITE is followed, in the same post, by a 1-byte READ of its last byte (the standard
//!   durable-write idiom: RC executes requests in order at the responder, so the READ's
//!   response implies the WRITE's data was placed). The extra READ is not counted in the stats.
//! - CAS and FAA are the device's 8-byte atomics and complete with the old value.
//! - Posts on one handle are executed one at a time (in arrival order); the completion queue is
//!   polled in a `spawn_blocking` thread, never on a runtime worker. The bounce buffer and the QP
//!   belong to that post until every completion has arrived, even if the caller's future is
//!   dropped, so the device never writes into memory that was freed or reused.
//! - Any failed work request leaves the QP in the error state: the handle is then broken for
//!   good (a remote access error reads as [`FabricError::AccessDenied`], the rest as
//!   [`FabricError::Transport`]); a caller reconnects with a new handle.
//!
//! What a completed WRITE means (durability):
//! - The idiom: every WRITE is followed, in the same post, by a 1-byte READ of its last byte,
//!   and the post completes when that READ's response is back. An RC responder executes a QP's
//!   requests in order and a READ response is not sent before the WRITE ahead of it is placed,
//!   so a completed WRITE is *placed* at the node: visible to its CPU and to every later READ.
//! - Real RNIC: placed means handed to the node's memory system. With Intel DDIO on (the
//!   default) the NIC's writes land in the last-level cache, outside the persistence domain of
//!   an ADR platform; placed is durable only on an eADR platform (caches inside the domain) or
//!   with DDIO off for the NIC's root port (writes then go to the memory controller, which ADR
//!   drains on power loss; the READ's completion cannot pass those posted PCIe writes). And the
//!   region must be PM: a pool on device-DAX (fsdax files cannot be registered, see below).
//! - Soft-RoCE (`rdma_rxe`): the responder is the node's kernel, which copies the payload into
//!   the MR's pages with ordinary CPU stores and never writes the lines back. On rxe a completed
//!   WRITE is visible at the node but sits in its CPU caches, not necessarily in PM: it
//!   survives the crash of any process (DPM and KN alike), not a power loss (unless eADR).
//! - Not used: the RDMA FLUSH verb (`IBV_WR_FLUSH`, IBTA 1.5; rxe has it from Linux 6.2, the test
//!   VM's Debian 6.1 kernel has not; it needs MRs registered with the flush access flags),
//!   which would make the responder write placed data back to the persistence domain and so
//!   close both gaps above. Everything the DPM writes itself (merges, GC, metadata) is persisted
//!   with CLWB + SFENCE on its own mapping, whatever the fabric.
//!
//! Where the region can live: registering it pins its pages. A page-cache or tmpfs file works.
//! A file on an fsdax mount does not: the kernel refuses long-term pins of fsdax pages
//! (`EOPNOTSUPP` on the test VM's Debian 6.1 kernel), while a device-DAX mapping (`/dev/daxX.Y`)
//! registers fine. See docs/decisions/0001-rdma-binding.md.
//!
//! Environment: `DINOMO_RDMA_DEVICE` picks the device by name (default: the first one),
//! `DINOMO_RDMA_GID_INDEX` the GID index (default: a RoCE v2 GID with an IPv4 address, else
//! the first usable one). Port 1 is used.

use std::collections::HashMap;
use std::fmt;
use std::net::{Ipv6Addr, SocketAddr};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use parking_lot::Mutex;
use sideway::ibverbs::address::{AddressHandleAttribute, Gid, GidType};
use sideway::ibverbs::completion::{BasicCompletionQueue, WorkCompletionStatus};
use sideway::ibverbs::device::{DeviceInfo, DeviceList};
use sideway::ibverbs::device_context::{DeviceContext, Mtu};
use sideway::ibverbs::memory_region::MemoryRegion;
use sideway::ibverbs::protection_domain::ProtectionDomain;
use sideway::ibverbs::queue_pair::{
    BasicQueuePair, PostSendGuard, QueuePair, QueuePairAttribute, QueuePairState,
    SetScatterGatherEntry, WorkRequestFlags,
};
use sideway::ibverbs::AccessFlags;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::error::{FabricError, Result};
use crate::grants::{GrantTable, KeyFence};
use crate::op::{AccessKey, Completion, Op};
use crate::pm::PmRegion;
use crate::stats::FabricStats;
use crate::Fabric;

/// The most work requests rung with one doorbell (also the send-queue depth).
pub const MAX_WR_PER_DOORBELL: usize = 256;
/// How often the node looks for keys revoked in the grant table behind its back.
pub const REVOKE_POLL: Duration = Duration::from_millis(100);
/// A post whose completions take longer than this breaks the handle.
pub const POST_TIMEOUT: Duration = Duration::from_secs(30);

const MAGIC: u64 = u64::from_le_bytes(*b"DNMVERBS");
const VERSION: u16 = 2;
const MAX_MSG: usize = 4096;
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
const PORT: u8 = 1;
/// Outstanding RDMA READs/atomics per QP we ask for (capped by the devices).
const RD_ATOMIC: u8 = 16;
/// Work requests that are the hidden durability READ carry this bit in their wr_id.
const FLUSH_BIT: u64 = 1 << 63;

const ST_OK: u8 = 0;
const ST_DENIED: u8 = 1;
const ST_ERROR: u8 = 2;

fn transport(msg: impl Into<String>) -> FabricError {
    FabricError::Transport(msg.into())
}

fn proto(msg: impl Into<String>) -> FabricError {
    FabricError::Protocol(msg.into())
}

/// An error and its sources in one line (sideway's errors keep the errno in the source).
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

fn verbs_err(what: &str) -> impl FnOnce(&dyn std::error::Error) -> FabricError + '_ {
    move |e| transport(format!("{what}: {}", chain(e)))
}

/// Names of the RDMA devices on this host (empty when there are none or libibverbs is absent).
pub fn device_names() -> Vec<String> {
    match DeviceList::new() {
        Ok(list) => list.iter().map(|d| d.name()).collect(),
        Err(_) => Vec::new(),
    }
}

/// The device, port and GID one side of a connection uses.
struct Device {
    ctx: Arc<DeviceContext>,
    name: String,
    gid_index: u8,
    gid: Gid,
    lid: u16,
    mtu: Mtu,
    /// The most outstanding READs/atomics this device takes as responder and as initiator.
    max_rd_atomic: u8,
    max_init_rd_atomic: u8,
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Device")
            .field("name", &self.name)
            .field("gid_index", &self.gid_index)
            .field("gid", &Ipv6Addr::from(self.gid))
            .field("mtu", &self.mtu)
            .finish()
    }
}

impl Device {
    /// Opens the device named `wanted`, else the one `DINOMO_RDMA_DEVICE` names, else the first.
    fn open(wanted: Option<&str>) -> Result<Self> {
        let list = DeviceList::new()
            .map_err(|e| FabricError::Config(format!("listing RDMA devices: {}", chain(&e))))?;
        let (wanted, from) = match wanted.filter(|s| !s.is_empty()) {
            Some(name) => (Some(name.to_string()), "asked for"),
            None => (
                std::env::var("DINOMO_RDMA_DEVICE")
                    .ok()
                    .filter(|s| !s.is_empty()),
                "DINOMO_RDMA_DEVICE",
            ),
        };
        let dev = match &wanted {
            Some(name) => list.iter().find(|d| d.name() == *name).ok_or_else(|| {
                let present: Vec<String> = list.iter().map(|d| d.name()).collect();
                FabricError::Config(format!(
                    "RDMA device {name:?} ({from}) not found; present: {}",
                    if present.is_empty() {
                        "none".to_string()
                    } else {
                        present.join(", ")
                    }
                ))
            })?,
            None => list
                .iter()
                .next()
                .ok_or_else(|| FabricError::Config("no RDMA device is present".into()))?,
        };
        let name = dev.name();
        let ctx = dev
            .open()
            .map_err(|e| transport(format!("opening {name}: {}", chain(&e))))?;
        drop(list);
        let port = ctx
            .query_port(PORT)
            .map_err(|e| transport(format!("{name} port {PORT}: {}", chain(&e))))?;
        let attr = ctx
            .query_device()
            .map_err(|e| transport(format!("{name}: {}", chain(&e))))?;
        let (gid_index, gid) = pick_gid(&ctx, &name)?;
        let cap = |v: i32| u8::try_from(v.clamp(1, i32::from(RD_ATOMIC))).unwrap_or(1);
        Ok(Device {
            name,
            gid_index,
            gid,
            lid: port.lid(),
            mtu: port.active_mtu(),
            max_rd_atomic: cap(attr.max_qp_rd_atom()),
            max_init_rd_atomic: cap(attr.max_qp_init_rd_atom()),
            ctx,
        })
    }

    /// A protection domain, a CQ and an RC QP in the INIT state.
    fn new_qp(&self, depth: usize, remote_access: bool) -> Result<QpParts> {
        let pd = self
            .ctx
            .alloc_pd()
            .map_err(|e| verbs_err("allocating a protection domain")(&e))?;
        let cq = self
            .ctx
            .create_cq_builder()
            .setup_cqe(depth as u32)
            .build()
            .map_err(|e| verbs_err("creating a completion queue")(&e))?;
        let mut qp = pd
            .create_qp_builder()
            .setup_max_send_wr(depth as u32)
            .setup_max_recv_wr(1)
            .setup_max_send_sge(1)
            .setup_max_recv_sge(1)
            .setup_max_inline_data(0)
            .setup_send_cq(cq.clone())
            .setup_recv_cq(cq.clone())
            .build()
            .map_err(|e| verbs_err("creating an RC queue pair")(&e))?;
        let access = if remote_access {
            AccessFlags::LocalWrite
                | AccessFlags::RemoteWrite
                | AccessFlags::RemoteRead
                | AccessFlags::RemoteAtomic
        } else {
            AccessFlags::LocalWrite
        };
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::Init)
            .setup_pkey_index(0)
            .setup_port(PORT)
            .setup_access_flags(access);
        qp.modify(&attr)
            .map_err(|e| verbs_err("moving the QP to INIT")(&e))?;
        Ok(QpParts {
            pd,
            cq,
            qp,
            psn: rand::random::<u32>() & 0x00ff_ffff,
        })
    }

    fn endpoint(&self, parts: &QpParts, rd_atomic: u8) -> Endpoint {
        Endpoint {
            qpn: parts.qp.qp_number(),
            psn: parts.psn,
            lid: self.lid,
            gid: self.gid,
            mtu: self.mtu as u32 as u8,
            rd_atomic,
        }
    }

    /// Moves an INIT QP to RTR then RTS, connected to `peer`.
    fn connect_qp(
        &self,
        parts: &mut QpParts,
        peer: &Endpoint,
        dest_rd_atomic: u8,
        init_rd_atomic: u8,
    ) -> Result<()> {
        let mtu = self.mtu.min(peer.mtu()?);
        let mut av = AddressHandleAttribute::new();
        av.setup_dest_lid(peer.lid)
            .setup_port(PORT)
            .setup_service_level(0)
            .setup_grh_src_gid_index(self.gid_index)
            .setup_grh_dest_gid(&peer.gid)
            .setup_grh_hop_limit(64);
        let mut attr = QueuePairAttribute::new();
        attr.setup_state(QueuePairState::ReadyToReceive)
            .setup_path_mtu(mtu)
            .setup_dest_qp_num(peer.qpn)
            .setup_rq_psn(peer.psn)
            .setup_max_dest_read_atomic(dest_rd_atomic)
            .setup_min_rnr_timer(12)
            .setup_address_vector(&av);
        parts
            .qp
            .modify(&attr)
            .map_err(|e| verbs_err("moving the QP to RTR")(&e))?;
        let mut attr = QueuePairAttribute::new();
        // timeout 16: 4.096 us * 2^16 = 268 ms per retry; generous because the test VM emulates
        // its CPU and Soft-RoCE runs in its kernel.
        attr.setup_state(QueuePairState::ReadyToSend)
            .setup_sq_psn(parts.psn)
            .setup_timeout(16)
            .setup_retry_cnt(7)
            .setup_rnr_retry(7)
            .setup_max_read_atomic(init_rd_atomic);
        parts
            .qp
            .modify(&attr)
            .map_err(|e| verbs_err("moving the QP to RTS")(&e))?;
        Ok(())
    }
}

/// Picks the GID: `DINOMO_RDMA_GID_INDEX`, else RoCE v2 with an IPv4 address, else RoCE v2,
/// else the first non-zero one.
fn pick_gid(ctx: &DeviceContext, name: &str) -> Result<(u8, Gid)> {
    if let Some(ix) = std::env::var("DINOMO_RDMA_GID_INDEX")
        .ok()
        .filter(|s| !s.is_empty())
    {
        let ix: u8 = ix.parse().map_err(|_| {
            FabricError::Config(format!(
                "DINOMO_RDMA_GID_INDEX={ix:?} is not a small integer"
            ))
        })?;
        let gid = ctx
            .query_gid(PORT, u32::from(ix))
            .map_err(|e| FabricError::Config(format!("{name} GID index {ix}: {}", chain(&e))))?;
        return Ok((ix, gid));
    }
    let table = ctx
        .query_gid_table()
        .map_err(|e| transport(format!("{name} GID table: {}", chain(&e))))?;
    let usable = |e: &&sideway::ibverbs::address::GidEntry| {
        e.port_num() == u32::from(PORT) && !e.gid().is_zero()
    };
    let v4 = |e: &&sideway::ibverbs::address::GidEntry| {
        Ipv6Addr::from(e.gid()).to_ipv4_mapped().is_some()
    };
    let v2 = |e: &&sideway::ibverbs::address::GidEntry| e.gid_type() == GidType::RoceV2;
    let entry = table
        .iter()
        .filter(usable)
        .find(|e| v2(e) && v4(e))
        .or_else(|| table.iter().filter(usable).find(v2))
        .or_else(|| table.iter().find(usable))
        .ok_or_else(|| FabricError::Config(format!("{name} has no usable GID on port {PORT}")))?;
    let ix = u8::try_from(entry.gid_index()).map_err(|_| {
        FabricError::Config(format!("{name}: GID index {} too large", entry.gid_index()))
    })?;
    Ok((ix, entry.gid()))
}

struct QpParts {
    // Field order is drop order: the QP goes before its CQ and PD.
    qp: BasicQueuePair,
    cq: Arc<BasicCompletionQueue>,
    pd: Arc<ProtectionDomain>,
    psn: u32,
}

/// One side's queue pair address, as exchanged on the side channel.
#[derive(Debug, Clone, Copy)]
struct Endpoint {
    qpn: u32,
    psn: u32,
    lid: u16,
    gid: Gid,
    mtu: u8,
    rd_atomic: u8,
}

impl Endpoint {
    fn put(&self, b: &mut BytesMut) {
        b.put_u32_le(self.qpn);
        b.put_u32_le(self.psn);
        b.put_u16_le(self.lid);
        b.put_slice(&self.gid.raw);
        b.put_u8(self.mtu);
        b.put_u8(self.rd_atomic);
    }

    fn get(b: &mut Bytes) -> Result<Self> {
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

    fn mtu(&self) -> Result<Mtu> {
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

fn need(b: &Bytes, n: usize) -> Result<()> {
    if b.remaining() < n {
        Err(proto(format!(
            "handshake message truncated: need {n} more bytes, have {}",
            b.remaining()
        )))
    } else {
        Ok(())
    }
}

async fn write_msg(sock: &mut TcpStream, body: &[u8]) -> Result<()> {
    let mut b = Vec::with_capacity(4 + body.len());
    b.extend_from_slice(&(body.len() as u32).to_le_bytes());
    b.extend_from_slice(body);
    sock.write_all(&b)
        .await
        .map_err(|e| transport(format!("side channel write: {e}")))
}

async fn read_msg(sock: &mut TcpStream) -> Result<Bytes> {
    let io = async {
        let mut len = [0u8; 4];
        sock.read_exact(&mut len).await?;
        let len = u32::from_le_bytes(len) as usize;
        if len > MAX_MSG {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("handshake message of {len} bytes exceeds {MAX_MSG}"),
            ));
        }
        let mut body = vec![0u8; len];
        sock.read_exact(&mut body).await?;
        Ok(Bytes::from(body))
    };
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, io).await {
        Ok(Ok(b)) => Ok(b),
        Ok(Err(e)) => Err(transport(format!("side channel read: {e}"))),
        Err(_) => Err(transport(format!(
            "side channel: no answer within {HANDSHAKE_TIMEOUT:?}"
        ))),
    }
}

fn check_magic(b: &mut Bytes) -> Result<()> {
    need(b, 8)?;
    let m = b.get_u64_le();
    if m != MAGIC {
        return Err(proto(format!(
            "not a verbs fabric handshake (magic {m:#x})"
        )));
    }
    Ok(())
}

// ------------------------------------------------------------------------------------------
// The memory node side.

/// One connected caller's registration: revoking drops `mr`, which deregisters it.
struct Registration {
    key: AccessKey,
    mr: Option<Arc<MemoryRegion>>,
}

struct NicShared {
    dev: Device,
    region: Arc<PmRegion>,
    grants: Arc<GrantTable>,
    conns: Mutex<HashMap<u64, Registration>>,
    next_conn: AtomicU64,
}

impl NicShared {
    /// Deregisters every live MR of `key` (or, with `None`, of every key the grant table no
    /// longer accepts). Returns how many were dropped.
    fn fence(&self, key: Option<AccessKey>) -> usize {
        let mut n = 0;
        let mut conns = self.conns.lock();
        for reg in conns.values_mut() {
            let revoked = match key {
                Some(k) => reg.key == k,
                None => self.grants.check(reg.key).is_err(),
            };
            if revoked && reg.mr.take().is_some() {
                n += 1;
            }
        }
        n
    }
}

/// The memory node's RDMA endpoint: serves one region to every caller that holds a grant.
pub struct VerbsNic {
    local_addr: SocketAddr,
    shared: Arc<NicShared>,
    accept: tokio::task::JoinHandle<()>,
    watcher: tokio::task::JoinHandle<()>,
    /// Dropped with the NIC: every connection task sees it and frees its QP and MR.
    _shutdown: watch::Sender<()>,
}

impl fmt::Debug for VerbsNic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsNic")
            .field("local_addr", &self.local_addr)
            .field("device", &self.shared.dev)
            .field("connections", &self.shared.conns.lock().len())
            .finish()
    }
}

impl VerbsNic {
    /// Opens the RDMA device (`DINOMO_RDMA_DEVICE`, else the first), binds the side channel on
    /// `addr` and starts serving `region` under the access rules of `grants`. Must run inside a
    /// tokio runtime.
    pub async fn start(
        addr: SocketAddr,
        region: Arc<PmRegion>,
        grants: Arc<GrantTable>,
    ) -> Result<Self> {
        Self::start_on(None, addr, region, grants).await
    }

    /// [`VerbsNic::start`] on the RDMA device named `device` (`None`: `DINOMO_RDMA_DEVICE`,
    /// else the first).
    pub async fn start_on(
        device: Option<&str>,
        addr: SocketAddr,
        region: Arc<PmRegion>,
        grants: Arc<GrantTable>,
    ) -> Result<Self> {
        let device = device.map(str::to_string);
        let dev = tokio::task::spawn_blocking(move || Device::open(device.as_deref()))
            .await
            .map_err(|e| transport(format!("opening the RDMA device: {e}")))??;
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| transport(format!("binding the verbs side channel to {addr}: {e}")))?;
        let local_addr = listener
            .local_addr()
            .map_err(|e| transport(e.to_string()))?;
        tracing::info!(%local_addr, device = %dev.name, gid = %Ipv6Addr::from(dev.gid), "verbs NIC started");
        let shared = Arc::new(NicShared {
            dev,
            region,
            grants,
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
        });
        let (shutdown, shutdown_rx) = watch::channel(());

        let s = shared.clone();
        let accept = tokio::spawn(async move {
            loop {
                let (sock, peer) = match listener.accept().await {
                    Ok(x) => x,
                    Err(e) => {
                        tracing::warn!(error = %e, "verbs side channel accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = sock.set_nodelay(true);
                let (s, rx) = (s.clone(), shutdown_rx.clone());
                tokio::spawn(async move {
                    if let Err(e) = serve_conn(sock, s, rx).await {
                        tracing::debug!(%peer, error = %e, "verbs connection ended");
                    }
                });
            }
        });

        let s = shared.clone();
        let watcher = tokio::spawn(async move {
            let mut tick = tokio::time::interval(REVOKE_POLL);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let n = s.fence(None);
                if n > 0 {
                    tracing::info!(
                        registrations = n,
                        "deregistered MRs of keys revoked in the grant table"
                    );
                }
            }
        });

        Ok(VerbsNic {
            local_addr,
            shared,
            accept,
            watcher,
            _shutdown: shutdown,
        })
    }

    /// The side channel's address (what callers connect to).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The RDMA device name this node serves on.
    pub fn device(&self) -> &str {
        &self.shared.dev.name
    }

    /// Revokes `key`: it is void in the grant table and every MR registered for it is
    /// deregistered now, so that caller's later one-sided operations fail at the device.
    pub fn revoke(&self, key: AccessKey) {
        if let Err(e) = self.shared.grants.revoke(key) {
            tracing::debug!(slot = key.slot, error = %e, "revoking a key the table does not know");
        }
        let n = self.shared.fence(Some(key));
        tracing::info!(slot = key.slot, registrations = n, "verbs access revoked");
    }
}

/// The DPM fences verbs callers through this (see the module doc, "Fencing").
impl KeyFence for VerbsNic {
    fn fence(&self, key: AccessKey) -> Result<()> {
        self.shared.grants.revoke(key)?;
        let n = self.shared.fence(Some(key));
        tracing::info!(slot = key.slot, registrations = n, "verbs access revoked");
        Ok(())
    }
}

impl Drop for VerbsNic {
    fn drop(&mut self) {
        self.accept.abort();
        self.watcher.abort();
    }
}

/// Removes a connection's registration when its task ends, however it ends.
struct ConnGuard {
    shared: Arc<NicShared>,
    id: u64,
}

impl Drop for ConnGuard {
    fn drop(&mut self) {
        self.shared.conns.lock().remove(&self.id);
    }
}

async fn serve_conn(
    mut sock: TcpStream,
    shared: Arc<NicShared>,
    mut shutdown: watch::Receiver<()>,
) -> Result<()> {
    let mut hello = read_msg(&mut sock).await?;
    check_magic(&mut hello)?;
    need(&hello, 2)?;
    let version = hello.get_u16_le();
    if version != VERSION {
        let msg = format!(
            "verbs handshake version {version} is not supported (this node speaks {VERSION})"
        );
        let mut b = BytesMut::new();
        b.put_u64_le(MAGIC);
        b.put_u8(ST_ERROR);
        b.put_u16_le(msg.len() as u16);
        b.put_slice(msg.as_bytes());
        write_msg(&mut sock, &b).await?;
        return Err(proto(msg));
    }
    need(&hello, 4 + 4 + 16)?;
    let slot = hello.get_u32_le();
    let generation = hello.get_u32_le();
    let mut secret = [0u8; 16];
    hello.copy_to_slice(&mut secret);
    let key = AccessKey {
        slot,
        generation,
        secret,
    };
    let peer = Endpoint::get(&mut hello)?;

    let id = shared.next_conn.fetch_add(1, Ordering::Relaxed);
    let s = shared.clone();
    let setup = tokio::task::spawn_blocking(move || accept_caller(&s, id, key, &peer))
        .await
        .map_err(|e| transport(format!("verbs connection setup panicked: {e}")))?;
    // From here on the registration (if any) is removed when this function returns.
    let guard = ConnGuard {
        shared: shared.clone(),
        id,
    };

    let mut reply = BytesMut::new();
    reply.put_u64_le(MAGIC);
    let (parts, rkey, dest_rd) = match setup {
        Ok(x) => x,
        Err(e) => {
            match &e {
                FabricError::AccessDenied { slot } => {
                    reply.put_u8(ST_DENIED);
                    reply.put_u32_le(*slot);
                }
                other => {
                    let msg = other.to_string();
                    let msg = &msg.as_bytes()[..msg.len().min(1024)];
                    reply.put_u8(ST_ERROR);
                    reply.put_u16_le(msg.len() as u16);
                    reply.put_slice(msg);
                }
            }
            write_msg(&mut sock, &reply).await?;
            return Err(e);
        }
    };
    reply.put_u8(ST_OK);
    shared.dev.endpoint(&parts, dest_rd).put(&mut reply);
    reply.put_u32_le(rkey);
    reply.put_u64_le(shared.region.as_ptr() as u64);
    reply.put_u64_le(shared.region.len());
    write_msg(&mut sock, &reply).await?;
    tracing::debug!(
        slot = key.slot,
        qpn = parts.qp.qp_number(),
        "verbs caller connected"
    );

    // The caller never sends anything more: the connection lives until it closes the side
    // channel (or the NIC is dropped). The QP, CQ and PD are freed when `parts` drops.
    let mut byte = [0u8; 1];
    let outcome = tokio::select! {
        r = sock.read(&mut byte) => match r {
            Ok(0) => Ok(()),
            Ok(_) => Err(proto("unexpected bytes on the verbs side channel")),
            Err(e) => Err(transport(format!("side channel: {e}"))),
        },
        _ = shutdown.changed() => Ok(()),
    };
    drop(guard);
    drop(parts);
    outcome
}

/// Checks the key and sets up the caller's PD, CQ, QP and MR, atomically with respect to
/// [`VerbsNic::revoke`] (both hold the registration lock), so a key revoked during setup never
/// ends up with a live MR.
/// Returns the QP, the rkey and how many READs/atomics the caller may keep outstanding.
fn accept_caller(
    shared: &NicShared,
    id: u64,
    key: AccessKey,
    peer: &Endpoint,
) -> Result<(QpParts, u32, u8)> {
    let dev = &shared.dev;
    let mut conns = shared.conns.lock();
    shared.grants.check(key)?;
    let mut parts = dev.new_qp(1, true)?;
    // SAFETY: the region's mapping stays valid for as long as `shared.region` lives, which
    // outlives this MR: the MR lives in `shared.conns`, owned by the same NicShared.
    let mr = unsafe {
        parts.pd.reg_mr(
            shared.region.as_ptr() as usize,
            shared.region.len() as usize,
            AccessFlags::LocalWrite
                | AccessFlags::RemoteWrite
                | AccessFlags::RemoteRead
                | AccessFlags::RemoteAtomic,
        )
    }
    .map_err(|e| {
        transport(format!(
            "registering the region ({} bytes at {}) with {}: {}",
            shared.region.len(),
            shared.region.path().display(),
            dev.name,
            chain(&e)
        ))
    })?;
    let dest_rd = dev.max_rd_atomic.min(peer.rd_atomic.max(1));
    dev.connect_qp(&mut parts, peer, dest_rd, dev.max_init_rd_atomic)?;
    let rkey = mr.rkey();
    conns.insert(id, Registration { key, mr: Some(mr) });
    Ok((parts, rkey, dest_rd))
}

// ------------------------------------------------------------------------------------------
// The caller side.

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

/// What the caller learnt about the node's region.
#[derive(Debug, Clone, Copy)]
struct Remote {
    rkey: u32,
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
    fn error(&self) -> FabricError {
        match self {
            Broken::Denied(slot) => FabricError::AccessDenied { slot: *slot },
            Broken::Transport(m) => FabricError::Transport(m.clone()),
        }
    }
}

/// The caller's QP and buffers; owned by one post at a time.
struct Conn {
    // Field order is drop order: the QP (which may still reference the bounce buffer) first.
    parts: QpParts,
    bounce: Bounce,
    dev: Device,
    remote: Remote,
    slot: u32,
    broken: Option<Broken>,
}

/// Where one work request's local bytes live in the bounce buffer.
#[derive(Clone, Copy)]
enum Wr {
    Read {
        op: usize,
        at: usize,
        len: u32,
        remote: u64,
    },
    Write {
        op: usize,
        at: usize,
        len: u32,
        remote: u64,
    },
    Flush {
        op: usize,
        at: usize,
        remote: u64,
    },
    Cas {
        op: usize,
        at: usize,
        remote: u64,
        expected: u64,
        new: u64,
    },
    Faa {
        op: usize,
        at: usize,
        remote: u64,
        add: u64,
    },
}

impl Wr {
    fn op(&self) -> usize {
        match *self {
            Wr::Read { op, .. }
            | Wr::Write { op, .. }
            | Wr::Flush { op, .. }
            | Wr::Cas { op, .. }
            | Wr::Faa { op, .. } => op,
        }
    }
}

fn align8(n: usize) -> usize {
    (n + 7) & !7
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
                rkey: 0,
                base: 0,
                len: 0,
            },
            slot: 0,
            broken: None,
        };
        Ok((conn, ep))
    }

    /// Plans the work requests of `ops` and their places in the bounce buffer.
    fn plan(&self, ops: &[Op]) -> (Vec<Wr>, usize) {
        // Offset 0..8 is the scratch the durability READs land in.
        let mut at = 8usize;
        let mut wrs = Vec::with_capacity(ops.len() * 2);
        for (i, op) in ops.iter().enumerate() {
            let remote = self.remote.base + op.offset();
            match op {
                Op::Read { len, .. } => {
                    if *len > 0 {
                        wrs.push(Wr::Read {
                            op: i,
                            at,
                            len: *len,
                            remote,
                        });
                        at += align8(*len as usize);
                    }
                }
                Op::Write { data, .. } => {
                    if !data.is_empty() {
                        let len = data.len() as u32;
                        wrs.push(Wr::Write {
                            op: i,
                            at,
                            len,
                            remote,
                        });
                        wrs.push(Wr::Flush {
                            op: i,
                            at: 0,
                            remote: remote + u64::from(len) - 1,
                        });
                        at += align8(data.len());
                    }
                }
                Op::Cas { expected, new, .. } => {
                    wrs.push(Wr::Cas {
                        op: i,
                        at,
                        remote,
                        expected: *expected,
                        new: *new,
                    });
                    at += 8;
                }
                Op::Faa { add, .. } => {
                    wrs.push(Wr::Faa {
                        op: i,
                        at,
                        remote,
                        add: *add,
                    });
                    at += 8;
                }
            }
        }
        (wrs, at)
    }

    /// Runs one post on the calling (blocking) thread.
    fn execute(&mut self, ops: &[Op]) -> Result<Vec<Completion>> {
        if let Some(b) = &self.broken {
            return Err(b.error());
        }
        let (wrs, need) = self.plan(ops);
        if need > self.bounce.buf.len() {
            let len = need.next_power_of_two().max(1 << 20);
            self.bounce = Bounce::new(&self.parts.pd, len)?;
        }
        // Stage the WRITE payloads.
        for wr in &wrs {
            if let Wr::Write { op, at, len, .. } = *wr {
                if let Op::Write { data, .. } = &ops[op] {
                    // SAFETY: `at + len <= need <= bounce length`; no request is in flight.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            data.as_ptr(),
                            self.bounce.buf.ptr.as_ptr().add(at),
                            len as usize,
                        )
                    };
                }
            }
        }
        for chunk in wrs.chunks(MAX_WR_PER_DOORBELL) {
            if let Err(e) = self.ring(chunk) {
                let b = match &e {
                    FabricError::AccessDenied { slot } => Broken::Denied(*slot),
                    other => Broken::Transport(other.to_string()),
                };
                self.broken = Some(b);
                return Err(e);
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
            match *wr {
                Wr::Read { op, at, len, .. } => {
                    // SAFETY: in the buffer, the READ has completed.
                    let s = unsafe { std::slice::from_raw_parts(base.add(at), len as usize) };
                    out[op] = Completion::Read(Bytes::copy_from_slice(s));
                }
                Wr::Cas { op, at, .. } => out[op] = Completion::Cas { old: word(at) },
                Wr::Faa { op, at, .. } => out[op] = Completion::Faa { old: word(at) },
                Wr::Write { .. } | Wr::Flush { .. } => {}
            }
        }
        Ok(out)
    }

    /// Posts `wrs` with one doorbell and waits for every completion.
    fn ring(&mut self, wrs: &[Wr]) -> Result<()> {
        let lkey = self.bounce.mr.lkey();
        let rkey = self.remote.rkey;
        let addr = |at| self.bounce.addr(at);
        let mut guard = self.parts.qp.start_post_send();
        for (n, wr) in wrs.iter().enumerate() {
            let flush = if matches!(wr, Wr::Flush { .. }) {
                FLUSH_BIT
            } else {
                0
            };
            let h = guard.construct_wr(n as u64 | flush, WorkRequestFlags::Signaled);
            // SAFETY: every local range lies in the registered bounce buffer, which this post
            // owns until its completions are polled below.
            unsafe {
                match *wr {
                    Wr::Read {
                        at, len, remote, ..
                    } => h.setup_read(rkey, remote).setup_sge(lkey, addr(at), len),
                    Wr::Write {
                        at, len, remote, ..
                    } => h.setup_write(rkey, remote).setup_sge(lkey, addr(at), len),
                    Wr::Flush { at, remote, .. } => {
                        h.setup_read(rkey, remote).setup_sge(lkey, addr(at), 1)
                    }
                    Wr::Cas {
                        at,
                        remote,
                        expected,
                        new,
                        ..
                    } => h
                        .setup_atomic_compare_swap(rkey, remote, expected, new)
                        .setup_sge(lkey, addr(at), 8),
                    Wr::Faa {
                        at, remote, add, ..
                    } => h
                        .setup_atomic_fetch_add(rkey, remote, add)
                        .setup_sge(lkey, addr(at), 8),
                }
            }
        }
        guard
            .post()
            .map_err(|e| transport(format!("ibv_post_send: {}", chain(&e))))?;

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
                return Err(transport(format!(
                    "{pending} of {} work requests did not complete within {POST_TIMEOUT:?}",
                    wrs.len()
                )));
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
            let name = status_name(status);
            if status == WorkCompletionStatus::RemoteAccessError as u32 {
                tracing::debug!(slot = self.slot, %what, "remote access error: the key was revoked");
                return Err(FabricError::AccessDenied { slot: self.slot });
            }
            return Err(transport(format!(
                "{what} failed on {}: {name} (status {status}, vendor error {vendor:#x})",
                self.dev.name
            )));
        }
        Ok(())
    }
}

fn describe(wr: &Wr) -> String {
    let op = wr.op();
    match wr {
        Wr::Read { len, .. } => format!("READ of {len} bytes (operation {op})"),
        Wr::Write { len, .. } => format!("WRITE of {len} bytes (operation {op})"),
        Wr::Flush { .. } => format!("durability READ after the WRITE (operation {op})"),
        Wr::Cas { .. } => format!("CAS (operation {op})"),
        Wr::Faa { .. } => format!("FAA (operation {op})"),
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
    remote: Remote,
    key: AccessKey,
    device: String,
    stats: FabricStats,
    /// Kept open for the handle's life: the node frees our QP and MR when it closes.
    _side: TcpStream,
}

impl fmt::Debug for VerbsFabric {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsFabric")
            .field("slot", &self.key.slot)
            .field("device", &self.device)
            .field("region_len", &self.remote.len)
            .finish()
    }
}

impl VerbsFabric {
    /// Connects to the [`VerbsNic`] whose side channel listens on `addr`, presenting `key`,
    /// through the local RDMA device `DINOMO_RDMA_DEVICE` (else the first one). Fails with
    /// [`FabricError::AccessDenied`] if the node does not accept the key.
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
        hello.put_u64_le(MAGIC);
        hello.put_u16_le(VERSION);
        hello.put_u32_le(key.slot);
        hello.put_u32_le(key.generation);
        hello.put_slice(&key.secret);
        local.put(&mut hello);
        write_msg(&mut sock, &hello).await?;

        let mut r = read_msg(&mut sock).await?;
        check_magic(&mut r)?;
        need(&r, 1)?;
        match r.get_u8() {
            ST_OK => {}
            ST_DENIED => {
                need(&r, 4)?;
                return Err(FabricError::AccessDenied {
                    slot: r.get_u32_le(),
                });
            }
            ST_ERROR => {
                need(&r, 2)?;
                let n = usize::from(r.get_u16_le());
                need(&r, n)?;
                let msg = String::from_utf8_lossy(&r.split_to(n)).into_owned();
                return Err(transport(format!(
                    "the verbs node at {addr} refused the connection: {msg}"
                )));
            }
            s => return Err(proto(format!("unknown handshake status {s}"))),
        }
        let peer = Endpoint::get(&mut r)?;
        need(&r, 4 + 8 + 8)?;
        let remote = Remote {
            rkey: r.get_u32_le(),
            base: r.get_u64_le(),
            len: r.get_u64_le(),
        };
        conn.remote = remote;
        conn.slot = key.slot;
        let init_rd = conn.dev.max_init_rd_atomic.min(peer.rd_atomic.max(1));
        let dest_rd = conn.dev.max_rd_atomic;
        let dev = &conn.dev;
        dev.connect_qp(&mut conn.parts, &peer, dest_rd, init_rd)?;
        let device = conn.dev.name.clone();
        tracing::debug!(%addr, slot = key.slot, device = %device, region_len = remote.len, "verbs fabric connected");
        Ok(VerbsFabric {
            conn: Arc::new(tokio::sync::Mutex::new(conn)),
            remote,
            key,
            device,
            stats: FabricStats::default(),
            _side: sock,
        })
    }

    /// The length of the node's region.
    pub fn region_len(&self) -> u64 {
        self.remote.len
    }
}

#[async_trait]
impl Fabric for VerbsFabric {
    async fn post(&self, ops: &[Op]) -> Result<Vec<Completion>> {
        self.stats.record_post(ops);
        validate(self.remote.len, ops)?;
        if ops.is_empty() {
            return Ok(Vec::new());
        }
        let mut conn = self.conn.clone().lock_owned().await;
        let ops = ops.to_vec();
        // The blocking task owns the connection until every completion is in, even if this
        // future is dropped meanwhile.
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
}
